"""Pure decisions: no device calls, no threads, no allocation. Each takes values (a plan, a
policy, measured figures) and returns a frozen value that the dry run prints and the engine
builds from.

* `layout`: `Layout`, `decide_layout` (every "auto" choice, once) and the re-plan after step 1.
* `flow`: `FlowPlan`, which units' weights flow and the prefetch depth.
* `buckets`: `BucketPlan` (parameters into buckets, ready order, device-resident buckets).
* `shard`: `ShardPlan` (this rank's range of every host bucket under data parallelism).
* `memory`: `BufferPolicy` and `footprint` (the bytes a plan needs, per kind and place), the
  arena layout.
* `snapshot_trade`: how many host buckets `speculation: auto` lets speculate.
* `cost_model`: `choose_plan(Machine, Workload) -> Plan` and `predict(...)`.
* `activations`: the device activation estimate of a Llama-style decoder and the tiling choice.

Submodules import one another directly; this package's __init__ imports nothing.
"""
