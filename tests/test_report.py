"""What an export reports (edgellm/report/): `compare`, the seed's results table for two exports,
and every op whose count moved."""

import json

import edgellm
from edgellm.cli import main


def test_compare_prints_the_seed_table_for_two_real_exports(exported, capsys):
    a_folder = exported("lfm2", backends="coreml")[0]
    b_folder = exported("lfm2", backends="coreml,xnnpack", verify=False, etrecord=False)[0]
    c = edgellm.compare(a_folder, b_folder / "report.json")
    a = json.loads((a_folder / "report.json").read_text())["methods"]["forward"]
    assert c["rows"]["A"]["delegated_nodes"] == a["delegation"]["delegated_nodes"]
    # the chain's XNNPACK pass decomposes the SDPA Core ML keeps whole
    assert c["op_deltas"]["aten_scaled_dot_product_attention_default"][1] == 0
    assert main(["compare", str(a_folder), str(b_folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split("\t") == ["", "subgraphs", "delegated nodes", "non-delegated",
                                  "deprecation warnings"]
    row = out[1].split("\t")
    assert row[0] == str(a_folder) and int(row[2]) == c["rows"]["A"]["delegated_nodes"]
    assert any("aten_scaled_dot_product_attention_default" in line and "(-2)" in line
               for line in out)
