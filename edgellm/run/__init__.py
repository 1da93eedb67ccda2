"""The run side: what uses an exported program once it is written. `session` holds a program in
conversation (tokenizer, chat template, what its caches hold) and `sampling` chooses its tokens,
for `edgellm generate`, `chat` (`chat`) and `serve` (`serve`); `benchmark` times it against the
memory-bandwidth floor; `openmp` sets the OpenMP team size before torch loads. The export stages
import none of it; they run programs through `edgellm.program`, as these modules do."""
