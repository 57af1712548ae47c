"""``SpeculativeRollout``: a Tunix rollout engine that samples through specjax's speculative engine.

Plug it into Tunix's ``RLCluster`` (``functools.partial`` carries the specjax arguments; Tunix
supplies ``rollout_actor``, ``tokenizer``, ``mesh`` and ``rollout_config``)::

    rollout = functools.partial(SpeculativeRollout, drafter=drafter, drafter_params=params,
                                engine_config=EngineConfig(...), metrics_jsonl=".../rollout.jsonl")
    cluster = RLCluster(actor=TunixPolicy(target), ..., cluster_config=ClusterConfig(
        rollout_engine=rollout, ...))
    cluster.rollout.attach(cluster)        # rollout metrics into Tunix's metrics logger

The drafter is frozen (its params never change during RL); verification (rejection sampling or
target-only, ``EngineConfig.method``) makes every rollout an exact sample of the *current* policy
whatever the drafter's quality. :meth:`update_params` hands the new policy weights to the engine
(same shapes, dtypes and shardings: nothing recompiles). A drafter that shares the target's
embedding / LM head (MTP, DSpark: ``frozen="shared"``) reads them from the current policy.

Honoured ``RolloutConfig`` knobs: ``max_tokens_to_generate``, ``temperature`` (0 = greedy),
``top_p``, ``top_k``, ``seed`` (request ``i`` of rollout call ``c`` gets its own seed from
``(seed, c, i)``), ``max_prompt_length``, ``eos_tokens`` (default: the tokenizer's EOS),
``return_logprobs``. ``kv_cache_size`` is ignored (the engine's ``max_len`` sizes its cache);
``data_type`` must be None or the model's dtype; any other knob set away from its default raises.

Completions follow Tunix's convention: they end before the first stop token (the stop token is not
part of ``tokens`` / ``text``). ``logprobs`` (when requested) are the exact log-probabilities of the
sampled tokens under the distribution they were drawn from (temperature, top-k, top-p);
:meth:`get_per_token_logps` follows Tunix's learner (temperature only, no filters), which is what
the GRPO ratio compares against.

Every rollout's metrics carry an exactness monitor, ``exactness_gap`` (± ``exactness_gap_se``):
the mean over sampled tokens of ``log p(x_t) + H_t``, which is 0 in expectation for exact samples
of the policy (:func:`specjax.rl.scoring.exactness_gap`). Pooled over a run's rollouts, a gap
many standard errors from 0 means the sampler is not drawing from the policy.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx

try:
    from tunix.rl.rollout import base_rollout
except ModuleNotFoundError:
    from specjax.rl import require_tunix
    require_tunix()  # without Tunix: an error that names the extra to install
    raise

from specjax.drafters.base import SharedHead, shared_head
from specjax.engine import Engine, EngineConfig, Request
from specjax.models.transformer import Transformer
from specjax.rl.policy import TunixPolicy
from specjax.rl.rollout_metrics import rollout_metrics
from specjax.rl.scoring import score_rows, tunix_logps
from specjax.scheduling import SchedulerConfig

__all__ = ["SpeculativeRollout", "HONOURED_KNOBS"]

HONOURED_KNOBS = ("max_tokens_to_generate", "temperature", "top_p", "top_k", "seed",
                  "max_prompt_length", "eos_tokens", "return_logprobs")
_IGNORED_KNOBS = ("kv_cache_size", "data_type")


def _unwrap(actor) -> Transformer:
    if isinstance(actor, TunixPolicy):
        return actor.model
    if isinstance(actor, Transformer):
        return actor
    raise TypeError(f"rollout_actor must be a TunixPolicy or a specjax Transformer, "
                    f"got {type(actor).__name__}")


def _filter_settings(rc) -> tuple[Optional[int], Optional[float]]:
    """``(top_k, top_p)`` a RolloutConfig asks for, each None when off (``top_k <= 0``,
    ``top_p >= 1``)."""
    top_k = rc.top_k if rc.top_k is not None and rc.top_k > 0 else None
    top_p = rc.top_p if rc.top_p is not None and rc.top_p < 1.0 else None
    return top_k, top_p


def _uses_filters(rc) -> bool:
    """Whether a RolloutConfig asks for top-k or top-p. The default engine compiles the filters
    (a sort over the vocabulary per drafted and verified position) only then: with them a batch of
    32 rollouts on the quickstart target took 2.1-2.7x as long, for the same tokens
    (``benchmarks/rl_rollout_speed.py``)."""
    return any(x is not None for x in _filter_settings(rc))


class SpeculativeRollout(base_rollout.BaseRollout):
    """Tunix ``BaseRollout`` over :class:`specjax.engine.Engine` (see the module docstring).

    Args:
      rollout_actor: the policy (:class:`TunixPolicy` or a specjax ``Transformer``).
      tokenizer: ``encode`` / ``decode`` / ``eos_id()`` / ``pad_id()`` (Tunix's
        ``TokenizerAdapter`` or :class:`specjax.rl.task.TunixTokenizer`); a non-None
        ``bos_id()`` is put before every text prompt.
      mesh: the rollout mesh (kept for Tunix; the engine runs where the weights live).
      rollout_config: the default ``RolloutConfig``.
      drafter, drafter_params: a specjax drafter and its (frozen) params.
      frozen: ``"shared"`` (the policy's embedding / LM head, kept current on updates), or the
        drafter's ``frozen`` argument as is (e.g. None for n-gram / draft-LM drafters).
      engine_config: the engine's shape and verification method; default: 8 slots, γ = 4, a
        fixed draft length, no overlap (which makes acceptance per position measurable), top-k /
        top-p filters compiled only when ``rollout_config`` asks for them (a later call that
        asks for them on an engine built without is refused).
      seed: base seed when the rollout config gives none.
      metrics_jsonl: append one JSON line of metrics per rollout call there.
      score_batch: rows per teacher-forced scoring call (fixed: one compilation).
    """

    def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, *,
                 drafter, drafter_params, frozen: Any = "shared",
                 engine_config: Optional[EngineConfig] = None, seed: int = 0,
                 metrics_jsonl: Optional[str] = None, score_batch: Optional[int] = None):
        if rollout_actor is None or tokenizer is None:
            raise ValueError("SpeculativeRollout needs rollout_actor and tokenizer")
        self._actor = rollout_actor
        self._target = _unwrap(rollout_actor)
        self._tokenizer = tokenizer
        self.mesh = mesh
        self._config = rollout_config or base_rollout.RolloutConfig()
        self._check_config(self._config)
        if engine_config is None:
            rc = self._config
            engine_config = EngineConfig(
                num_slots=8, gamma=4, max_len=rc.max_prompt_length + rc.max_tokens_to_generate + 6,
                scheduler=SchedulerConfig("fixed", k=4), overlap=False,
                filters=_uses_filters(rc))
        self._shared = isinstance(frozen, str)
        if self._shared and frozen != "shared":
            raise ValueError(f"frozen must be 'shared' or the drafter's frozen pytree, got {frozen!r}")
        fr = shared_head(self._target) if self._shared else frozen
        if self._shared and not isinstance(fr, SharedHead):
            raise TypeError("shared_head did not return a SharedHead")
        graphdef, state = nnx.split(self._target)
        devices = {d for x in jax.tree.leaves(state) for d in x.devices()}
        if len(devices) > 1:
            # The engine decodes on one device: a policy spread over a mesh is served from a copy
            # on its first device (refreshed, device to device, at every weight sync).
            one = jax.sharding.SingleDeviceSharding(min(devices, key=lambda d: d.id))
            state = jax.device_put(state, one)
            fr = jax.device_put(fr, one)
            drafter_params = jax.device_put(drafter_params, one)
        self.engine = Engine((graphdef, state), drafter, drafter_params, fr, engine_config)
        # Warm-up (compilation) happens at the first generate(): Tunix calls the rollout inside its
        # mesh context, which is part of jit's cache key, so compiling here would compile twice.
        self._warm = False
        self._source = jax.tree.leaves(nnx.state(self._target))  # arrays the engine serves
        self._seed = int(seed)
        self._calls = 0
        self._version = 0
        self._metrics_jsonl = metrics_jsonl
        self._sink: Optional[Callable[[dict], None]] = None
        self._score_batch = int(score_batch or engine_config.num_slots)
        self.last_metrics: Optional[dict] = None
        self.last_batch: Optional[dict] = None

    # ------------------------------------------------------------------------------ Tunix API
    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self):
        return self._actor

    def attach(self, rl_cluster) -> "SpeculativeRollout":
        """Buffers every rollout's metrics into ``rl_cluster``'s metrics logger (prefix
        ``rollout/``; TensorBoard event files with Tunix's default backends)."""
        from tunix.rl import rl_cluster as rl_cluster_lib

        def sink(metrics, mode=rl_cluster_lib.Mode.TRAIN):
            rl_cluster.buffer_metrics(
                {f"rollout/{k}": (v, np.mean) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and v is not None}, mode=mode)
        self._sink = sink
        return self

    def update_params(self, params, filter_types=None) -> None:
        """Loads ``params`` (a state of the rollout actor, e.g. ``nnx.state(actor, nnx.Param)``)
        into the actor and hands the target's state to the engine. Shapes and dtypes must match
        the engine's; arrays on another sharding are moved to the engine's (no recompilation)."""
        del filter_types  # the state says which variables it holds
        if params is not None:
            holder = self._actor
            if isinstance(holder, Transformer) and "model" in params:
                params = params["model"]
            nnx.update(holder, params)
        self._sync(force=True)

    def _sync(self, force: bool = False) -> None:
        """Serves the actor's current weights. Tunix skips ``update_params`` when the rollout's
        model is the learner's own module (colocated: "shared weights"), and its optimizer
        replaces the module's arrays in place; so every rollout checks for new arrays first."""
        new = nnx.state(self._target)
        new_leaves, new_def = jax.tree.flatten(new)
        if not force and self._source is not None and len(new_leaves) == len(self._source) and \
                all(a is b for a, b in zip(new_leaves, self._source)):
            return
        old_leaves, old_def = jax.tree.flatten(self.engine.target_state)
        if new_def != old_def:
            raise ValueError("update_params: the new policy state's structure differs from the "
                             "engine's")
        moved = []
        for a, b in zip(new_leaves, old_leaves):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"update_params: a weight changed from {b.shape} {b.dtype} to "
                                 f"{a.shape} {a.dtype}; the engine serves fixed shapes and dtypes")
            moved.append(a if a.sharding == b.sharding else jax.device_put(a, b.sharding))
        self.engine.target_state = jax.tree.unflatten(new_def, moved)
        if self._shared:  # a view of the engine's (single-device) arrays
            self.engine.frozen = shared_head(nnx.merge(self.engine.graphdef,
                                                       self.engine.target_state))
        self._source = new_leaves
        self._version += 1

    def set_drafter_params(self, params) -> None:
        """Serves new drafter params (e.g. after an online update, :mod:`specjax.rl.online`).
        Same structure, shapes and dtypes as the current ones (nothing recompiles); whatever the
        drafter, verification keeps every rollout an exact sample of the policy."""
        old_leaves, old_def = jax.tree.flatten(self.engine.params)
        new_leaves, new_def = jax.tree.flatten(params)
        if new_def != old_def:
            raise ValueError("set_drafter_params: the params' structure differs from the engine's")
        moved = []
        for a, b in zip(new_leaves, old_leaves):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"set_drafter_params: {b.shape} {b.dtype} -> {a.shape} {a.dtype}")
            moved.append(a if getattr(a, "sharding", None) == b.sharding
                         else jax.device_put(a, b.sharding))
        self.engine.params = jax.tree.unflatten(new_def, moved)

    def get_per_token_logps(self, prompt_tokens, completion_tokens, completion_mask=None):
        """``log softmax(logits / T)`` of each completion token (Tunix's learner convention: the
        rollout temperature, no top-k / top-p), float32 ``[B, C]``."""
        del completion_mask  # padded entries are masked by the learner
        self._sync()
        t = self._config.temperature
        return tunix_logps(self.engine.graphdef, self.engine.target_state,
                           jax.numpy.asarray(prompt_tokens), jax.numpy.asarray(completion_tokens),
                           float(t) if t else 1.0, pad_id=self.pad_id())

    def generate(self, prompts: Sequence, rollout_config=None, *, mode: str = "train", **kwargs):
        """Samples one completion per prompt through the speculative engine. ``mode`` tags the
        metrics ("train" rollouts go to the attached Tunix logger, every mode to the JSONL)."""
        rc = rollout_config or self._config
        self._check_config(rc)
        self._config = rc
        prompt_ids = [self._encode(p) for p in prompts]
        p_len, n_new = rc.max_prompt_length, rc.max_tokens_to_generate
        for ids in prompt_ids:
            if not 0 < len(ids) <= p_len:
                raise ValueError(f"a prompt has {len(ids)} tokens; RolloutConfig.max_prompt_length "
                                 f"is {p_len} (prompts are not truncated)")
        stops = tuple(int(t) for t in (rc.eos_tokens or [self.eos_id()]))
        top_k, top_p = _filter_settings(rc)
        base = self._seed if rc.seed is None else int(np.asarray(rc.seed).ravel()[0])
        seeds = np.random.SeedSequence([base, self._calls]).generate_state(len(prompts))
        requests = [Request(prompt=ids, max_new_tokens=n_new, stop_tokens=stops,
                            temperature=float(rc.temperature), top_k=top_k, top_p=top_p,
                            seed=int(s) & 0x7FFFFFFF) for ids, s in zip(prompt_ids, seeds)]
        self._sync()
        if not self._warm:
            self.engine.warmup(profile=False)
            self._warm = True
        since = (len(self.engine.stats), len(getattr(self.engine, "loop_stats", [])))
        t0 = time.perf_counter()
        results = self.engine.generate(requests)
        wall = time.perf_counter() - t0
        for r in results:
            if r.finish_reason == "error":
                raise RuntimeError(f"speculative rollout failed: {r.error}")
        logp, ent = self._score(prompt_ids, [r.tokens for r in results], rc, top_k, top_p)
        completions = []
        for r in results:
            toks = np.asarray(r.tokens, np.int32)
            cut = next((i for i, t in enumerate(toks) if int(t) in stops), len(toks))
            completions.append(toks[:cut])
        padded = np.full((len(prompts), p_len), self.pad_id(), np.int32)
        for i, ids in enumerate(prompt_ids):
            padded[i, p_len - len(ids):] = ids
        metrics = {"rollout": self._calls, "weights_version": self._version,
                   **rollout_metrics(self.engine, results, requests, logp, ent, wall, since),
                   "mode": mode}
        # per-sequence detail for studies (clustered errors, online drafter updates)
        self.last_batch = {"prompts": prompt_ids, "results": results, "entropy": ent}
        self._record(metrics)
        self._calls += 1
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(c.tolist()) for c in completions],
            logits=[], tokens=completions, left_padded_prompt_tokens=padded,
            logprobs=[lp[:len(c)] for lp, c in zip(logp, completions)]
            if getattr(rc, "return_logprobs", False) else None)

    # ------------------------------------------------------------------------------ internals
    def _check_config(self, rc) -> None:
        default = base_rollout.RolloutConfig()
        bad = []
        for f in dataclasses.fields(rc):
            if f.name in HONOURED_KNOBS or f.name in _IGNORED_KNOBS:
                continue
            if getattr(rc, f.name) != getattr(default, f.name):
                bad.append(f.name)
        if bad:
            raise ValueError(f"SpeculativeRollout does not support RolloutConfig knobs {bad}; it "
                             f"honours {list(HONOURED_KNOBS)}")
        dt = rc.data_type
        if dt is not None and np.dtype(dt) != np.dtype(self._target.config.dtype):
            raise ValueError(f"RolloutConfig.data_type {dt} differs from the model's compute dtype "
                             f"{self._target.config.dtype}; the engine serves the policy as is")
        if rc.temperature < 0:
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {rc.temperature}")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            bos = getattr(self._tokenizer, "bos_id", lambda: None)()
            ids = self._tokenizer.encode(str(prompt))
            return ([int(bos)] if bos is not None else []) + [int(t) for t in ids]
        arr = np.asarray(prompt)
        if arr.ndim == 0 and arr.dtype.kind in "US":
            return self._encode(str(arr))
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"a prompt must be text or a 1-D sequence of token ids, got "
                            f"{type(prompt).__name__} {arr.dtype} {arr.shape}")
        return [int(t) for t in arr if int(t) != self.pad_id()]

    def _score(self, prompt_ids, outputs, rc, top_k, top_p):
        """Exact log-probs and entropies of every generated token (stop tokens included) under
        the sampling distribution: a teacher-forced forward through the current policy."""
        length = rc.max_prompt_length + rc.max_tokens_to_generate
        n, b = len(outputs), self._score_batch
        rows = np.zeros((n + (-n) % b, length), np.int32)
        for i, (p, o) in enumerate(zip(prompt_ids, outputs)):
            rows[i, :len(p) + len(o)] = list(p) + list(o)
        t = np.full(b, rc.temperature, np.float32)
        k = None if top_k is None else np.full(b, top_k, np.int32)
        tp = None if top_p is None else np.full(b, top_p, np.float32)
        lps, ents = [], []
        for s in range(0, len(rows), b):
            lp, en = score_rows(self.engine.graphdef, self.engine.target_state, rows[s:s + b],
                                t, k, tp)
            lps.append(np.asarray(lp))
            ents.append(np.asarray(en))
        lp, en = np.concatenate(lps), np.concatenate(ents)
        out_lp = [lp[i, len(p) - 1:len(p) - 1 + len(o)] for i, (p, o) in
                  enumerate(zip(prompt_ids, outputs))]
        out_en = [en[i, len(p) - 1:len(p) - 1 + len(o)] for i, (p, o) in
                  enumerate(zip(prompt_ids, outputs))]
        return out_lp, out_en

    def _record(self, metrics: dict) -> None:
        self.last_metrics = metrics
        if self._metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(self._metrics_jsonl)), exist_ok=True)
            with open(self._metrics_jsonl, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self._sink is not None and metrics["mode"] == "train":
            self._sink(metrics)
