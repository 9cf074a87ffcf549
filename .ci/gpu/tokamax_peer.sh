# Sourced by the GPU scripts (after `out` is set, from the repository root): tokamax, the optional
# benchmark peer (Python >= 3.12), from wheels carried in .whl/ (the GPU machine has no network;
# ../shared/GPU.md says how to fetch them), installed into .tk/ with a stand-in for the profiler
# it imports only for its own benchmarks, and put on PYTHONPATH. Nothing happens without wheels.
if ls .whl/tokamax-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .tk .whl/*.whl >>"$out/build.log" 2>&1
  mkdir -p .tk/xprof/cli && touch .tk/xprof/__init__.py .tk/xprof/cli/__init__.py
  echo "get_kernel_stats_tool = None" >.tk/xprof/cli/tools.py
  export PYTHONPATH="$PWD/.tk${PYTHONPATH:+:$PYTHONPATH}"
  echo "tokamax: $(python3 -c 'import tokamax; print(tokamax.__version__)' 2>&1 | tail -1)"
fi
