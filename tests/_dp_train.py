"""What each rank runs in the data-parallel tests (spawned by _dist.run_ranks): the engine on its
own micro-batches, and, on every rank, the stock reference on every rank's micro-batches (the
rank-averaged gradient: the sum of the ranks' gradients divided by N, then clip_grad_norm_, skip
on a non-finite norm, torch.optim.AdamW), compared parameter by parameter after every step."""

from __future__ import annotations

import hashlib
import logging
import math
import types
from typing import Optional

import torch

from _models import (
    GradPoison,
    RelativeMaxNorm,
    assert_adam_state_close,
    assert_params_close,
    engine_config,  # noqa: F401  (re-exported for test_dp)
    micro_batches,
    read_params,
)
from superoffload_hf.testing.engine_parts import parts


LAYERS = 4  # TinyLM's blocks


class TinyLM(torch.nn.Module):
    """A causal LM small enough to start fast in a spawned process (no transformers import):
    embedding, residual MLP blocks with LayerNorm, a head (`tied`: the embedding's weight);
    `model(**batch).loss`."""

    def __init__(self, vocab: int = 128, hidden: int = 32, layers: int = LAYERS, tied: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
            torch.nn.Linear(2 * hidden, hidden)) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.skip: frozenset = frozenset()  # indices of layers this forward leaves out (no gradient)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            h = h + layer(h)
        logits = self.head(h)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss)


def tiny_llama(seed: int = 0, tied: bool = False) -> TinyLM:  # the name the checks below use
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(tied=tied)

LR = 1e-3
CLIPS = {"never": lambda step: 1e6, "always": lambda step: 1e-3, "mild": lambda step: RelativeMaxNorm(0.9),
         "none": lambda step: None}


def rank_batches(step: int, rank: int, world: int, accumulation: int) -> list[dict]:
    return micro_batches(step * world + rank, accumulation)


def skipped_layers(skip: Optional[dict], rank: int, step: int, micro: int) -> frozenset:
    """The layers rank `rank` leaves out of micro-batch `micro` of `step`: `skip` maps (rank, step)
    (every micro-batch) or (rank, step, micro) to layer indices."""
    if not skip:
        return frozenset()
    return frozenset(skip.get((rank, step), ())) | frozenset(skip.get((rank, step, micro), ()))


def unused_everywhere(skip: Optional[dict], world: int, step: int, accumulation: int, idle) -> frozenset:
    """The layers no rank runs in any micro-batch of `step` (their parameters get no gradient)."""
    layers = every = frozenset(range(LAYERS))
    for r in range(world):
        if (r, step) in idle:
            continue
        for micro in range(accumulation):
            layers -= every - skipped_layers(skip, r, step, micro)
    return layers


def params_digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(read_params(model).items()):
        h.update(p.detach().clone().numpy().tobytes())  # (a copy: numpy() pins the storage's size, which weight-flow resizes)
    return h.hexdigest()


def reference_step(ref, ref_opt, step, world, accumulation, clip, poison: Optional[GradPoison],
                   poison_rank: int, idle=(), skip: Optional[dict] = None) -> tuple[bool, float, Optional[float]]:
    for r in range(world):
        if (r, step) in idle:
            continue  # that rank has no gradient this step: it contributes zeros to the average
        if poison is not None:
            poison.step = step if r == poison_rank else -1
        for micro, batch in enumerate(rank_batches(step, r, world, accumulation)):
            ref.skip = skipped_layers(skip, r, step, micro)  # absent there: zeros in the average
            (ref(**batch).loss / (accumulation * world)).backward()
    ref.skip = frozenset()
    params = [p for p in ref.parameters() if p.grad is not None]
    if isinstance(clip, RelativeMaxNorm):
        clip = clip.resolve(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
    total = float(torch.nn.utils.clip_grad_norm_(params, math.inf if clip is None else clip))
    skipped = not math.isfinite(total)
    if not skipped:
        ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    return skipped, total, clip


def train(rank: int, world: int, speculation: str = "on", clip: str = "mild", steps: int = 6,
          accumulation: int = 1, poison_rank: Optional[int] = None, poison_steps=(2,),
          config: Optional[dict] = None, check_state: bool = True, start_step: int = 0,
          save_dir: Optional[str] = None, load_dir: Optional[str] = None,
          shard_group_size: Optional[int] = None, idle=(), skip: Optional[dict] = None,
          eps: float = 1e-8, poison_value: float = float("nan"), tied: bool = False) -> dict:
    """Returns the per-step parameter digests (bitwise identity across ranks is the caller's).
    `idle`: (rank, step) pairs where that rank runs no backward at all; `skip`: layers a rank leaves
    out of a step or micro-batch (see skipped_layers); where every rank leaves a layer out, its
    parameters' master and moments must come out of the step bitwise unchanged (as torch.optim
    skips a parameter whose grad is None).
    `save_dir`: after training, every rank saves its optimizer state (a shard file per rank, or
    optimizer.pt in one process) and rank 0 the weights and the stock reference's model and
    optimizer; `load_dir`: start from there (the reference continues the saved stock run).
    `tied`: the head's weight is the embedding's (one parameter), in the model and the reference."""
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp import checkpoint as shard_checkpoint

    model = tiny_llama(seed=rank, tied=tied)  # rank 0's weights must win (the optimizer broadcasts them)
    ref = tiny_llama(seed=0, tied=tied)
    if load_dir is not None:
        model.load_state_dict(torch.load(f"{load_dir}/model.pt", weights_only=True))
        ref.load_state_dict(torch.load(f"{load_dir}/ref_model.pt", weights_only=True))
    cfg = engine_config(speculation=speculation, gradient_accumulation_steps=accumulation, **(config or {}))
    group = None
    if shard_group_size is not None:  # shard within groups, replicate across them
        import torch.distributed as dist

        group, _ = dist.new_subgroups(group_size=shard_group_size)
    flow = {"model": model} if cfg.get("weights", "stationary") != "stationary" else {}  # weight-flow hooks its blocks
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, eps=eps, config=cfg, process_group=group,
                            **flow)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2, eps=eps, foreach=False)
    if load_dir is not None:
        ref_opt.load_state_dict(torch.load(f"{load_dir}/ref_opt.pt", weights_only=True))
        if shard_checkpoint.shard_files(load_dir):
            opt.load_state_dict(shard_checkpoint.read_shards(load_dir))
        else:
            opt.load_state_dict(torch.load(f"{load_dir}/optimizer.pt", weights_only=True, mmap=True))
    target = dict(model.named_parameters())["layers.1.1.weight"]
    ref_target = dict(ref.named_parameters())["layers.1.1.weight"]
    values = {s: poison_value for s in poison_steps}
    poison = GradPoison(target, values) if poison_rank == rank else None
    ref_poison = GradPoison(ref_target, values) if poison_rank is not None else None
    digests, skipped = [], []
    held_log = _LogLines("held")
    package_logger = logging.getLogger("superoffload_hf")
    level = package_logger.level
    package_logger.addHandler(held_log)
    package_logger.setLevel(logging.INFO)
    try:
        assert_params_close(model, ref, "after construction", exact=load_dir is None)
        for step in range(start_step, start_step + steps):
            where = f"rank {rank}/{world} step {step}"
            ref_skipped, ref_norm, max_norm = reference_step(ref, ref_opt, step, world, accumulation,
                                                             CLIPS[clip](step), ref_poison, poison_rank, idle, skip)
            opt.max_grad_norm = max_norm
            if poison is not None:
                poison.step = step
            unused = _layer_params(model, unused_everywhere(skip, world, step, accumulation, idle))
            before = _pieces(opt, unused)
            for micro, batch in enumerate(rank_batches(step, rank, world, accumulation)):
                if (rank, step) in idle:
                    break
                model.skip = skipped_layers(skip, rank, step, micro)
                (model(**batch).loss / accumulation).backward()
            model.skip = frozenset()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _assert_untouched(before, _pieces(opt, unused), where)
            assert opt.last_step_skipped == ref_skipped, f"{where}: skipped {opt.last_step_skipped}, torch {ref_skipped}"
            if not ref_skipped:
                assert abs(opt.last_grad_norm - ref_norm) <= 1e-5 * ref_norm, f"{where}: norm {opt.last_grad_norm} vs {ref_norm}"
            assert_params_close(model, ref, where)
            digests.append(params_digest(model))
            skipped.append(ref_skipped)
        if check_state and world > 1:
            from superoffload_hf.engine.dp.checkpoint import RangeSource, consolidate
            import torch.distributed as dist

            shards = [None] * world
            dist.all_gather_object(shards, opt.state_dict())
            shards = list({s["rank"]: s for s in shards}.values())  # replicas hold the same shard
            full = consolidate(RangeSource.of(shards))
            assert_adam_state_close(_Wrapped(full), ref_opt, f"rank {rank}: consolidated state")
        if save_dir is not None:
            sd = opt.state_dict()
            if world > 1:
                opt.save_sharded(save_dir)
            else:
                torch.save(sd, f"{save_dir}/optimizer.pt")
            weights = model.state_dict()  # on every rank: under data parallel weight-flow a gather (collective)
            if rank == 0:
                torch.save(weights, f"{save_dir}/model.pt")
                torch.save(ref.state_dict(), f"{save_dir}/ref_model.pt")
                torch.save(ref_opt.state_dict(), f"{save_dir}/ref_opt.pt")
        counters = opt.counters.as_dict()
    finally:
        package_logger.removeHandler(held_log)
        package_logger.setLevel(level)
        opt.close()
    return {"digests": digests, "skipped": skipped, "counters": counters, "summary": opt.describe(),
            "held_log": held_log.lines}


class _LogLines(logging.Handler):
    """The engine's log messages that contain `word` (at any level)."""

    def __init__(self, word: str):
        super().__init__(logging.DEBUG)
        self.word, self.lines = word, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.word in message:
            self.lines.append(message)


def _layer_params(model, layers: frozenset) -> list[int]:
    """Optimizer indices (the model's parameter order) of the parameters of `layers`."""
    return [i for i, (name, _) in enumerate(model.named_parameters())
            if name.startswith("layers.") and int(name.split(".")[1]) in layers]


def _pieces(opt, indices: list[int]) -> dict:
    """This rank's state (step, master, moments: copies) of the parameters `indices`."""
    if not indices:
        return {}
    sd = opt.state_dict()
    pieces = sd["pieces"] if "pieces" in sd else sd["state"]
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in pieces[i].items()}
            for i in indices if i in pieces}


def _assert_untouched(before: dict, after: dict, where: str) -> None:
    assert before.keys() == after.keys(), f"{where}: state of {sorted(set(before) ^ set(after))} appeared"
    for i, entry in before.items():
        assert int(after[i]["step"]) == int(entry["step"]), f"{where}: parameter {i} without a gradient was stepped"
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            if key in entry:
                assert torch.equal(after[i][key], entry[key]), f"{where}: parameter {i} {key} changed without a gradient"


class _Wrapped:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd


def launch_order_learned(rank: int, world: int, steps: int = 3) -> dict:
    """The optimizer gets the parameters in an order unrelated to the forward's (every layer's
    parameters, then the head, then the embedding, in a fixed shuffle), so the plan's guessed
    launch order is wrong at step 1. Per step and launch during backward: whether the bucket
    launched is the one that just completed (else it waited behind one ahead of it)."""
    import random

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp import route as dp_module

    model = tiny_llama(seed=0)
    params = list(model.parameters())
    random.Random(7).shuffle(params)
    opt = SuperOffloadAdamW(params, lr=LR, config=engine_config(speculation="on"))
    log: list[list[bool]] = []
    launch = dp_module.DataParallel.launch

    def recording(self, rt, spec):
        log[-1].append(bool(self._ready_seq) and self._ready_seq[-1] == rt.bucket.index)
        return launch(self, rt, spec)

    dp_module.DataParallel.launch = recording
    try:
        for step in range(steps):
            log.append([])
            for batch in rank_batches(step, rank, world, 1):
                model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        dp_module.DataParallel.launch = launch
    host = sum(1 for rt in parts(opt).buckets.host())
    return {"log": log, "host_buckets": host, "digest": params_digest(model)}


def collective_order(rank: int, world: int, steps: int = 4, slow_gather_rank: int = 1) -> dict:
    """Every torch.distributed collective this rank issues, in issue order across its threads:
    (operation, the group's role, thread, whether Collectives.issue_lock was held). Layer 2 is left
    out of the forward at step 2 (so it waits for no copy-back of its bucket, queued last) and rank
    `slow_gather_rank`'s worker issues that bucket's all-gather 0.5 s late: without an ordering between the
    threads that rank would issue step 2's first reduce-scatter before step 1's last all-gather."""
    import threading
    import time as time_module

    import torch.distributed as dist

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp import route as dp_module

    log: list[tuple] = []
    holder: dict = {}
    names = [n for n in ("all_reduce", "broadcast", "reduce_scatter_single", "reduce_scatter_tensor",
                         "all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def recording(name):
        def call(*args, **kwargs):
            coll = holder.get("coll")
            log.append((name, kwargs.get("group"), threading.current_thread().name,
                        None if coll is None else coll.issue_lock.locked()))
            return originals[name](*args, **kwargs)
        return call

    from superoffload_hf.engine.dp.gather import ShardGather

    gather_back = ShardGather.gather_back

    def slow_gather_back(self, rt):
        if rank == slow_gather_rank and rt.bucket.index == 0:  # layers[2]'s, queued last
            time_module.sleep(0.5)
        return gather_back(self, rt)

    model = tiny_llama(seed=0)
    # layers[2] last: the plan's first host bucket holds it alone, and step() queues that bucket's
    # copy-back last, so the forward that skips layers[2] waits for none of the worker's all-gathers
    late = list(model.layers[2].parameters())
    params = [p for p in model.parameters() if all(p is not q for q in late)] + late
    for n in names:
        setattr(dist, n, recording(n))
    ShardGather.gather_back = slow_gather_back
    try:
        opt = SuperOffloadAdamW(params, lr=LR, config=engine_config(speculation="on"))
        first = parts(opt).buckets.host()[0] if isinstance(parts(opt).buckets.host(), list) else next(iter(parts(opt).buckets.host()))
        assert {s.index for s in first.bucket.slots} == set(range(len(params) - len(late), len(params))), first.bucket
        coll = holder["coll"] = parts(opt).route.coll
        constructed = len(log)
        for step in range(steps):
            model.skip = frozenset({2}) if step == 2 else frozenset()
            for batch in rank_batches(step, rank, world, 1):
                model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize() if hasattr(opt, "synchronize") else parts(opt).synchronize()
        groups = coll.groups()  # close() releases them
        opt.close()
    finally:
        for n in names:
            setattr(dist, n, originals[n])
        ShardGather.gather_back = gather_back
    roles = {id(group): role for role, group in groups}
    named = [(op, roles.get(id(group), "other"), thread, locked) for op, group, thread, locked in log]
    return {"construction": named[:constructed], "training": named[constructed:],
            "roles": [role for role, _ in groups]}


def default_group_collective_each_step(rank: int, world: int, steps: int = 2, late_gather_rank: int = 1,
                                       late_caller_rank: int = 0, delay_s: float = 0.5) -> str:
    """The Trainer's pattern: a collective on the default group at the start of every step (its
    token count, accelerator.gather) from code the engine does not own, then forward, backward,
    step(). Rank `late_gather_rank`'s worker issues its copy-backs' all-gathers `delay_s` late and
    rank `late_caller_rank` calls the default-group collective `delay_s` after step() returned: an
    engine that returned from step() before its all-gathers were issued would let the two
    communicators' collectives interleave in opposite orders on the two ranks (_dist compares them).
    Returns the weights' digest."""
    import time as time_module

    import torch.distributed as dist

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp.gather import ShardGather

    gather_back = ShardGather.gather_back
    late = {"next": False}  # the first copy-back of each step only (the step's first all-gather)

    def late_gather_back(self, rt):
        if late["next"]:
            late["next"] = False
            time_module.sleep(delay_s)
        return gather_back(self, rt)

    model = tiny_llama(seed=0)
    if rank == late_gather_rank:
        ShardGather.gather_back = late_gather_back
    try:
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=engine_config(speculation="on"))
        for step in range(steps):
            batches = rank_batches(step, rank, world, 1)
            if rank == late_caller_rank and step > 0:
                time_module.sleep(delay_s)
            tokens = torch.tensor([sum(b["labels"].numel() for b in batches)])
            dist.all_reduce(tokens)  # the default group, as the Trainer's token count
            for batch in batches:
                model(**batch).loss.backward()
            late["next"] = True
            opt.step()
            opt.zero_grad()
        digest = params_digest(model)
        opt.close()
    finally:
        ShardGather.gather_back = gather_back
    return digest


# ---- compact host state: data parallel against one process on the same global batch -------------


def compact_state(opt, world: int) -> dict:
    """Every parameter's saved state (the consolidated shard files under data parallelism, the
    state dict in one process): {index: {key: CPU tensor}}, copies."""
    from superoffload_hf.engine.dp.checkpoint import RangeSource, consolidate

    sd = opt.state_dict()
    if world > 1:
        import torch.distributed as dist

        shards = [None] * world
        dist.all_gather_object(shards, sd)
        sd = consolidate(RangeSource.of(shards))
    return {int(i): {k: v.detach().reshape(-1).clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
            for i, entry in sd["state"].items()}


def train_compact(rank: int, world: int, steps: int = 6, start_step: int = 0, state_precision: str = "compact",
                  speculation: str = "on", max_grad_norm: float = 1e6, poison: tuple = (1, 2),
                  save_dir: Optional[str] = None, load_dir: Optional[str] = None, global_world: int = 2,
                  weights: str = "stationary") -> dict:
    """A bf16 TinyLM with compact (or fp32) host state. Under data parallelism (`world` > 1) rank r
    runs the micro-batch rank_batches(step, r, ...); in one process (`world` 1) the optimizer
    accumulates all `global_world` ranks' micro-batches of the step (the same global batch,
    each loss / global_world). `poison`: (rank, step) whose micro-batch gets a NaN gradient in
    layers.1.1.weight (the step is skipped). Returns the per-step parameter digests, skips, the
    final saved state, and the conversion notices a load logged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks (_dist.py): bf16 LayerNorm backward sums per thread
    try:
        return _train_compact(rank, world, steps, start_step, state_precision, speculation, max_grad_norm, poison,
                              save_dir, load_dir, global_world, weights)
    finally:
        torch.set_num_threads(threads)


def _train_compact(rank, world, steps, start_step, state_precision, speculation, max_grad_norm, poison, save_dir,
                   load_dir, global_world, weights) -> dict:
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp import checkpoint as shard_checkpoint

    model = tiny_llama(seed=0)
    if load_dir is not None:
        model.load_state_dict(torch.load(f"{load_dir}/model.pt", weights_only=True))
    micro = 1 if world > 1 else global_world
    cfg = engine_config(device_dtype="bf16", state_precision=state_precision, speculation=speculation,
                        gradient_accumulation_steps=micro, device_buckets=0, weights=weights)
    notices = _LogLines("converted")
    package_logger = logging.getLogger("superoffload_hf")
    package_logger.addHandler(notices)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, config=cfg,
                            **({"model": model} if weights != "stationary" else {}))
    try:
        if load_dir is not None:
            saved = (shard_checkpoint.read_shards(load_dir) if shard_checkpoint.shard_files(load_dir)
                     else torch.load(f"{load_dir}/optimizer.pt", weights_only=True, mmap=True))
            opt.load_state_dict(saved)
        loaded = compact_state(opt, world) if load_dir is not None else None
        target = dict(model.named_parameters())["layers.1.1.weight"]
        poisoner = GradPoison(target, {poison[1]: float("nan")})
        opt.max_grad_norm = max_grad_norm
        digests, skipped, norms = [], [], []
        for step in range(start_step, start_step + steps):
            ranks = [rank] if world > 1 else range(global_world)
            for r in ranks:
                poisoner.step = step if r == poison[0] else -1
                for batch in rank_batches(step, r, global_world, 1):
                    (model(**batch).loss / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            skipped.append(opt.last_step_skipped)
            norms.append(opt.last_grad_norm)
            digests.append(bf16_digest(model))
        state = compact_state(opt, world)
        if save_dir is not None:
            weights_sd = model.state_dict()  # on every rank: under data parallel weight-flow a gather (collective)
            if rank == 0:  # before save_sharded's barriers: no rank loads it early
                torch.save(weights_sd, f"{save_dir}/model.pt")
            if world > 1:
                opt.save_sharded(save_dir)
            else:
                torch.save(opt.state_dict(), f"{save_dir}/optimizer.pt")
        counters = opt.counters.as_dict()
        summary = opt.describe()
    finally:
        package_logger.removeHandler(notices)
        opt.close()
    return {"digests": digests, "skipped": skipped, "norms": norms, "state": state, "loaded": loaded, "counters": counters,
            "notices": notices.lines, "summary": summary}


def bf16_digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(read_params(model).items()):
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
