"""What each rank runs in the sequence-parallel tests (spawned by _dist.run_ranks): a tiny Llama
(8 query heads, 2 key/value heads) trained with Ulysses over SP groups and SuperOffloadAdamW over
the world, and, on every rank, the stock reference: one process, the same weights, every DP
replica's whole batch (the mean of the replicas' losses), clip_grad_norm_, torch.optim.AdamW;
losses, gradient norms and every parameter compared after every step."""

from __future__ import annotations

import math

import torch

from _models import assert_params_close, engine_config, read_params

LR = 1e-3
# Adam's update g / (|g| + eps) turns a tiny gradient's relative rounding error (an embedding row
# whose contributions nearly cancel, summed in another order over the shards) into the update's:
# with eps 1e-8 one element in ~10^4 moved 2.6e-6 (0.2% of its update) from one process; 1e-6
# keeps the comparison about the gradients.
EPS = 1e-6
HEADS, KV_HEADS = 8, 2


def sp_llama(attn: str, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation=attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def replica_batch(step: int, dp_rank: int, seq: int, padded: bool) -> dict:
    """DP replica `dp_rank`'s batch at `step`: 2 rows of `seq` tokens; `padded`: the second row
    right-padded (attention_mask zeros, labels ignored there, as a collator makes them)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, 96, (2, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, seq - 5:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def rows(batches: list[dict]) -> dict:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def train(rank: int, world: int, sp_size: int, attn: str = "sdpa", steps: int = 3, seq: int = 30,
          padded: bool = False, max_norm: float = 0.05, replicas: int | None = None, start_step: int = 0,
          save_dir: str | None = None, load_dir: str | None = None) -> dict:
    """`replicas`: how many replica batches make the global batch (default: the DP size); each
    SP group takes replicas / DP of them, as rows of one batch (the same numbers as the mean of
    their losses when their target counts are equal: not `padded`). `save_dir`: after training,
    the optimizer's shards (every rank), the weights and the reference (rank 0); `load_dir`:
    start from there, at `start_step` (checkpoints made under another DP x SP)."""
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp import checkpoint as shard_checkpoint
    from superoffload_hf.parallel import SequenceParallel, sequence_parallel_groups

    groups = sequence_parallel_groups(sp_size)
    replicas = replicas or groups.dp_size
    per = replicas // groups.dp_size
    mine = range(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    model = sp_llama(attn, seed=rank)  # rank 0's weights must win (the optimizer broadcasts them)
    ref = sp_llama(attn, seed=0)
    if load_dir is not None:
        model.load_state_dict(torch.load(f"{load_dir}/model.pt", weights_only=True))
        ref.load_state_dict(torch.load(f"{load_dir}/ref_model.pt", weights_only=True))
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, eps=EPS, config=engine_config(speculation="on"))
    sp = SequenceParallel(model, groups.group, optimizer=opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2, eps=EPS, foreach=False)
    if load_dir is not None:
        ref_opt.load_state_dict(torch.load(f"{load_dir}/ref_opt.pt", weights_only=True))
        if shard_checkpoint.shard_files(load_dir):
            opt.load_state_dict(shard_checkpoint.read_shards(load_dir))
        else:
            opt.load_state_dict(torch.load(f"{load_dir}/optimizer.pt", weights_only=True))
    losses, clipped = [], []
    try:
        assert_params_close(model, ref, "after construction", exact=load_dir is None)
        for step in range(start_step, start_step + steps):
            where = f"rank {rank}/{world} (SP {sp_size}) step {step}"
            ref_losses = []
            for d in range(replicas):
                loss_d = ref(**replica_batch(step, d, seq, padded)).loss
                (loss_d / replicas).backward()
                ref_losses.append(float(loss_d.detach()))
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

            opt.max_grad_norm = max_norm
            loss = sp(**sp.shard_batch(rows([replica_batch(step, d, seq, padded) for d in mine])))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            want = sum(ref_losses[d] for d in mine) / per
            got = float(loss.detach())
            assert abs(got - want) <= 1e-5 * abs(want), f"{where}: loss {got} vs one process {want}"
            assert math.isfinite(ref_norm) and ref_norm > max_norm, f"{where}: norm {ref_norm} does not clip"
            assert abs(opt.last_grad_norm - ref_norm) <= 1e-5 * ref_norm, \
                f"{where}: norm {opt.last_grad_norm} vs one process {ref_norm}"
            assert_params_close(model, ref, where)
            losses.append(got)
            clipped.append(ref_norm)
        params = {name: p.detach().clone() for name, p in read_params(model).items()}
        if save_dir is not None:
            opt.save_sharded(save_dir)
            if rank == 0:
                torch.save(model.state_dict(), f"{save_dir}/model.pt")
                torch.save(ref.state_dict(), f"{save_dir}/ref_model.pt")
                torch.save(ref_opt.state_dict(), f"{save_dir}/ref_opt.pt")
            if world > 1:
                import torch.distributed as dist

                dist.barrier()  # rank 0's files are written before any rank resumes from them
    finally:
        opt.close()
    return {"losses": losses, "norms": clipped, "dp_rank": groups.dp_rank, "steps": steps,
            "digest": sum(float(p.double().sum()) for p in params.values())}


def scenarios(rank: int, world: int, runs: list) -> list:
    """Several `train` runs in one spawn (starting processes that import transformers is most
    of the cost)."""
    return [train(rank, world, **kw) for kw in runs]
