"""The byte-level language model of the examples, as a small library.

train_lm.py, train_lm_sharded.py and generate.py import its modules; the scripts put
``examples/`` on ``sys.path``, so nothing needs installing. Importing the package itself imports
no JAX: lm.host_devices runs before JAX starts.

    config.py        Config (the experiment), its presets, RunOptions (one invocation)
    flags.py         the command line: a flag per Config / RunOptions field, preset <- file <- flags
    attention.py     the model's attention: jax_flash or jax.nn's xla / cudnn, checked up front
    data.py          the text as bytes, the train/validation split, (input, target) windows
    model.py         ByteLM: the NNX transformer (rotary or learned positions, GQA), KV cache
    training.py      optimizer, (model, optimizer) state, jit-compiled steps, the training loop
    sampling.py      generate: bytes from a trained model (sliding window, no cache)
    generation.py    batched generation with the model's KV cache: prefill, then a decode loop
    checkpoints.py   orbax checkpoints and resuming
    reporting.py     history, progress bar, memory, plots, metrics.json, comparison table
    runs.py          train (one run, end to end) and compare (one run per attention)
    packing.py       train_lm.py --pack: packed documents (segment ids) against padding, tokens/s
    host_devices.py  simulated CPU devices (set before JAX starts)
    collectives.py   the collectives of a compiled SPMD step, read from its HLO
"""
