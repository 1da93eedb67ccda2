"""Configs: YAML, key=value overrides, one validation pass that reports every problem."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgellm.config import apply_overrides, from_dict, parse_override, resolve_config
from edgellm.errors import ConfigError


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        from_dict({"max_seq_lenn": 3, "dtype": "int3", "backends": ["coreml"],
                   "coreml": {"state": "coreml", "min_ios": 17, "precison": "fp16"}})
    text = str(e.value)
    assert "unknown key 'max_seq_lenn'. Did you mean 'max_seq_len'?" in text
    assert "dtype: 'int3' is not one of fp32, fp16, bf16" in text
    assert "unknown key 'coreml.precison'. Did you mean 'coreml.precision'?" in text
    assert "coreml.state: 'coreml' needs min_ios 18" in text
    assert len(e.value.problems) == 4


def test_coreml_state_needs_ios18():
    with pytest.raises(ConfigError, match=r"coreml\.state: 'coreml' needs min_ios 18"):
        from_dict({"backends": "coreml", "coreml": {"state": "coreml", "min_ios": 17}})


def test_options_for_a_backend_not_in_the_chain_are_refused():
    with pytest.raises(ConfigError, match="options given for backend 'coreml', which is not in"):
        from_dict({"backends": "xnnpack", "coreml": {"min_ios": 17}})


def test_wrong_types_and_ranges():
    with pytest.raises(ConfigError, match=r"max_seq_len: expected an integer, got 'long'.*"
                       r"etrecord: expected true or false"):
        from_dict({"max_seq_len": "long", "etrecord": "yes"})
    with pytest.raises(ConfigError, match="max_context_len: 8 is smaller than max_seq_len 16"):
        from_dict({"max_seq_len": 16, "max_context_len": 8})


def test_precedence_file_then_overrides_then_options(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backends: [coreml]\nmax_seq_len: 64\ncoreml:\n  min_ios: 17\n")
    cfg = resolve_config(config=path, overrides=["+coreml.precision=fp32", "max_seq_len=96"],
                         max_seq_len=128)
    assert cfg.max_seq_len == 128 and cfg.backends == ("coreml",)
    opts = cfg.options_for("coreml")
    assert (opts.min_ios, opts.precision) == (17, "fp32")


@pytest.mark.parametrize("text", ["novalue", "=3", "a..b=1", ".a=1"])
def test_malformed_overrides(text):
    with pytest.raises(ConfigError, match="is not of the form key=value"):
        parse_override(text)


keys = st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=3)
scalars = st.one_of(st.integers(-10**6, 10**6), st.booleans(),
                    st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True).filter(
                        lambda s: s not in {"true", "false", "yes", "no", "on", "off", "null",
                                            "y", "n"}))


@given(keys, scalars)
def test_override_round_trip(path, value):
    """Whatever the dotted key and scalar, key=value puts exactly that value at that path."""
    text = ".".join(path) + "=" + (str(value).lower() if isinstance(value, bool) else str(value))
    assert parse_override(text) == (path, value)
    out = apply_overrides({}, [text])
    node = out
    for part in path[:-1]:
        node = node[part]
    assert node[path[-1]] == value


def test_a_misspelt_keyword_of_the_python_api_gets_the_nearest_field():
    with pytest.raises(ConfigError, match=r"unknown key 'max_seq_lenght'\. Did you mean "
                                          r"'max_seq_len'\?"):
        resolve_config(None, max_seq_lenght=4)
