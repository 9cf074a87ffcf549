"""Checkpoints: orbax saves of the (model, optimizer) state with the step, config and history,
and the rules for resuming a run from them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx

from lm.config import RESUME_FIXED, Config, RunOptions


class CheckpointStore:
  """Orbax checkpoints of the (model, optimizer) state plus a JSON item (step, config, history).

  Saves are synchronous: the state is donated to the next step right after, and the tokens/s of
  the run should not share the machine with a background writer.
  """

  def __init__(self, directory: str, keep: int):
    import orbax.checkpoint as ocp
    from orbax.checkpoint.checkpoint_managers import preservation_policy

    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=preservation_policy.LatestN(keep),
            enable_async_checkpointing=False, create=True))

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: nnx.State, meta: dict[str, Any]) -> None:
    """Saves `state` and the JSON `meta` as `step` and waits until they are written."""
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int, like: nnx.State) -> tuple[nnx.State, dict[str, Any]]:
    """Restores `step` into arrays shaped, typed and placed like `like`."""
    ocp = self._ocp
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON item saved at `step` (no arrays are read)."""
    ocp = self._ocp
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def close(self) -> None:
    """Releases the manager."""
    self._manager.close()


def resume_config(store: CheckpointStore, step: int, overrides: dict[str, Any]) -> Config:
  """The config saved at `step`, with the flags given now applied; the data and shape fields must
  not change (a different --attention, --dtype, --steps or learning rate is fine)."""
  saved = Config.from_dict(store.read_meta(step)["config"])
  changed = [k for k in RESUME_FIXED if k in overrides and overrides[k] != getattr(saved, k)]
  if changed:
    raise SystemExit(
        "error: --resume keeps the checkpoint's " + ", ".join(
            f"--{k.replace('_', '-')} ({getattr(saved, k)!r}, not {overrides[k]!r})"
            for k in changed))
  config = dataclasses.replace(saved, **overrides)
  try:
    config.validate()
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  return config


def open_checkpoints(config: Config, options: RunOptions, overrides: dict[str, Any]
                     ) -> tuple[CheckpointStore | None, Config, int | None]:
  """Opens --checkpoint-dir; returns (store or None, the run's config, the step to resume from).

  With --resume and a checkpoint there, the config is the checkpoint's with `overrides` applied.
  Without --resume, a directory that already holds checkpoints is refused.
  """
  if options.checkpoint_dir is None:
    if options.resume:
      raise SystemExit("error: --resume needs --checkpoint-dir")
    return None, config, None
  store = CheckpointStore(options.checkpoint_dir, options.keep_checkpoints)
  latest = store.latest_step()
  if latest is None:
    if options.resume:
      print(f"no checkpoint in {store.directory} yet: starting from step 0")
    return store, config, None
  if not options.resume:
    store.close()
    raise SystemExit(f"error: {store.directory} already holds checkpoints (latest step "
                     f"{latest}): add --resume to continue from it, or use another directory")
  return store, resume_config(store, latest, overrides), latest
