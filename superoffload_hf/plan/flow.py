"""Which units' weights flow (config `weights`) and how deep the prefetch goes, decided before
anything is allocated from the layout's device memory (plan/memory.py footprint, the
activations as given) against the device's free memory, and the depth again after the first
step from the measured link and forward time (engine/core.py _learn).

* `decide_weights`: "stationary" or "flow" for the run; "stationary" that does not fit is refused.
* `choose_flow` ("auto"): the fewest units flowing that fit, the units whose fetch hides best
  first (`hiding_order`: forward compute per byte fetched).
* `choose_depth`: the shallowest prefetch that hides what a deeper one would (`exposed_seconds`,
  a simulation of the forward and backward on one link), within the device memory left.

Pure given the machine's facts (plan/layout.py MachineFacts): no device calls. `FlowPlan` (which
units flow, their bytes, the depth) and the units of a model (`find_units`, `plan_flow`) are
here too; engine/flow.py runs the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from superoffload_hf.plan.memory import footprint

DEFAULT_DEPTH = 1  # units fetched ahead of the one running


@dataclass(frozen=True)
class UnitSpec:
    name: str
    params: tuple[int, ...]  # indices into the engine's parameters
    nbytes: int  # device bytes of its weights


@dataclass(frozen=True)
class FlowPlan:
    units: tuple[UnitSpec, ...]  # the flowing units, in model order
    stationary: tuple[str, ...] = ()  # units kept on the device, and why
    depth: int = DEFAULT_DEPTH

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def peak_bytes(self) -> int:
        """The most flowing weight bytes on the device at once: a unit and the `depth` after it
        (backward: before it) in model order, or a unit used at both ends (tied) and those."""
        sizes = [u.nbytes for u in self.units]
        window = self.depth + 1
        if not sizes:
            return 0
        spans = [sum(sizes[i:i + window]) for i in range(max(1, len(sizes) - window + 1))]
        return max(spans) + (max(sizes) if any("+" in u.name for u in self.units) else 0)

    def describe(self) -> str:
        if not self.units:
            return "weights stationary"
        kept = f", {len(self.stationary)} stationary" if self.stationary else ""
        return (f"weights flow: {len(self.units)} units{kept}, prefetch depth {self.depth}, "
                f"{self.nbytes / 1e6:.3f} MB on the host, <= {self.peak_bytes / 1e6:.3f} MB on the device")


def find_units(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """(name, root modules) per unit: each child of the largest ModuleList (by parameters: the
    decoder blocks), then every other module owning parameters directly, merged where they share
    a parameter (a tied embedding and head)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    blocks_name, blocks = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()), default=(None, None))
    units: list[tuple[str, list[torch.nn.Module]]] = []
    inside = set()
    if blocks is not None:
        for j, block in enumerate(blocks):
            units.append((f"{blocks_name}.{j}", [block]))
            inside.update(id(m) for m in block.modules())
    others: list[tuple[str, list[torch.nn.Module], set]] = []
    for name, module in model.named_modules():
        if id(module) in inside or not any(True for _ in module.parameters(recurse=False)):
            continue
        owned = {id(p) for p in module.parameters(recurse=False)}
        merged = next((o for o in others if o[2] & owned), None)
        if merged is None:
            others.append((name, [module], owned))
        else:
            others[others.index(merged)] = (f"{merged[0]}+{name}", merged[1] + [module], merged[2] | owned)
    return units + [(name, modules) for name, modules, _ in others]


def unit_params(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    seen, params = set(), []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def plan_flow(model: torch.nn.Module, params: list[torch.Tensor], depth: int = DEFAULT_DEPTH,
              element_bytes: Optional[int] = None) -> FlowPlan:
    """`element_bytes`: of the device dtype (default: as the parameters are now)."""
    index_of = {id(p): i for i, p in enumerate(params)}
    flowing, kept = [], []
    for name, modules in find_units(model):
        ps = unit_params(modules)
        if not all(id(p) in index_of and p.requires_grad for p in ps):
            kept.append(f"{name} (parameters the optimizer does not train)")
            continue
        flowing.append(UnitSpec(name, tuple(index_of[id(p)] for p in ps),
                                sum(p.numel() * (element_bytes or p.element_size()) for p in ps)))
    return FlowPlan(tuple(flowing), tuple(kept), depth)



DEVICE_MARGIN_SHARE = 0.05
"""The least share of the device's memory `weights: auto` leaves free. torch's caching allocator
keeps a pool per stream: weight-flow's fetched weights are allocated on the flow stream, the
activations on the compute stream, and a block one pool caches cannot serve the other; it also
rounds every block (to 512 bytes, large ones in 2 MiB granules cut from 20 MiB segments), so the
sum of the requests is less than what the device gives up. 5% is a choice (no GPU has run this
yet), raised to the allocator's slack measured at construction where that is larger
(`device_margin`)."""


def device_margin(total_bytes: int, slack_bytes: int = 0) -> int:
    """The device bytes "auto" keeps free: the caching allocator's slack measured now
    (`slack_bytes`: reserved less allocated, what its pools hold beyond what they serve), and at
    least DEVICE_MARGIN_SHARE of the device's `total_bytes`."""
    return max(int(DEVICE_MARGIN_SHARE * total_bytes), int(slack_bytes))


def choose_weights(choice: str, weight_bytes: int, buffer_bytes: int, free_bytes: int, total_bytes: int,
                   all_ranks_fit: Optional[Callable[[bool], bool]] = None, margin_bytes: int = 0) -> str:
    """"auto": flow when the weights and the engine's device buffers do not fit in the free device
    memory less `margin_bytes` (device_margin); "stationary" that does not fit is refused here,
    before anything is trained (the user chose it: no margin is imposed). Data parallel:
    `all_ranks_fit(fits_here)` (a collective every rank calls) says whether they fit on every
    rank, so that every rank decides the same (flow where any rank's device is too small)."""
    fits_here = weight_bytes + buffer_bytes + (margin_bytes if choice == "auto" else 0) <= free_bytes
    fits = fits_here if all_ranks_fit is None else all_ranks_fit(fits_here)
    if choice == "auto":
        return "stationary" if fits else "flow"
    if choice == "stationary" and not fits:
        where = (" (this rank's device has room, another rank's has not: every rank keeps its weights the same "
                 "way)" if fits_here else "")
        raise torch.OutOfMemoryError(
            f"`weights: stationary` keeps {weight_bytes} bytes of weights on the device, plus {buffer_bytes} "
            f"bytes of the engine's device buffers and the activations, but {free_bytes} of the device's "
            f"{total_bytes} bytes are free{where}. Set `weights: flow` (or \"auto\") to stream the weights from "
            "the host block by block, or use a device with more memory.")
    return choice


def decide_weights(choice: str, plan, stationary_policy, machine, model: Optional[torch.nn.Module],
                   activation_bytes: int = 0, all_ranks_fit: Optional[Callable[[bool], bool]] = None) -> str:
    """"stationary" or "flow" (config `weights`: `choice`) for this run: what the stationary layout
    (`plan` under `stationary_policy`) puts on the device against the device's free memory
    (`machine`: plan/layout.py MachineFacts) and `activation_bytes`. On the CPU device nothing is checked (the host
    memory check covers it), nor where the device's memory is not known (the dry run's default)."""
    if not machine.host_is_device and machine.free_bytes is not None:
        rows = footprint(plan, stationary_policy)
        weight_bytes = sum(r.nbytes for r in rows if r.what == "device params")
        buffer_bytes = sum(r.nbytes for r in rows if r.place == "device" and r.what != "device params")
        free = machine.free_bytes
        if not machine.params_counted:  # a real device: the model is on it
            free += weight_bytes
        choice = choose_weights(choice, weight_bytes, buffer_bytes + activation_bytes, free, machine.total_bytes,
                                all_ranks_fit, machine.margin_bytes)
    elif choice == "auto":
        choice = "stationary"  # the device is the host (nothing to free), or its memory is unknown
    check_model_given(choice, model)
    return choice


def check_model_given(choice: str, model) -> None:
    if choice == "flow" and model is None:
        raise ValueError("`weights` is \"flow\" (or \"auto\" chose it) but the optimizer was not given the model: "
                         "weight-flow hooks the model's blocks. Pass `model=model` to SuperOffloadAdamW (the "
                         "Trainer and Accelerate integrations do), or set `weights: stationary`.")


# ---- per unit: which units flow, at which prefetch depth ---------------------------------------

MAX_DEPTH = 4
"""The deepest prefetch `choose_depth` considers (units fetched ahead of the one running)."""
DEPTH_TOLERANCE = 0.01
"""A deeper prefetch must hide more than this fraction of the step's exposed transfer time to be
chosen: every unit fetched ahead holds its weights on the device."""
BACKWARD_FACTOR = 2.0
"""A unit's backward computes about twice its forward (the gradients of its inputs and of its
weights)."""


@dataclass(frozen=True)
class UnitCost:
    """One unit (engine/flow.py UnitSpec) as the choice sees it, in forward order."""

    name: str
    nbytes: int  # device bytes of its weights: what a fetch moves
    compute: int  # its forward's matrix-multiply elements (weights of its non-embedding layers): FLOPs / (2 x tokens)


@dataclass(frozen=True)
class FlowChoice:
    """Which units flow and how deep the prefetch goes, with the device memory it predicts (pure
    data: `choose_flow` and `choose_depth` make it, the Layout holds it, the dry run prints it)."""

    units: tuple[UnitCost, ...]  # every unit that may flow, in forward order
    flowing: tuple[bool, ...]  # per unit
    depth: int
    other_bytes: int  # on the device besides the weights: the engine's buffers and the activations
    activation_bytes: int
    free_bytes: Optional[int]  # the device memory the choice fits into, the margin taken off (None: not known)
    exposed_s: Optional[float] = None  # predicted exposed transfer seconds per step (None: not timed yet)
    reason: str = ""
    margin_bytes: int = 0  # the device memory left free besides (device_margin)

    @property
    def flowing_names(self) -> tuple[str, ...]:
        return tuple(u.name for u, f in zip(self.units, self.flowing) if f)

    @property
    def peak_stationary(self) -> int:
        """The device's weights and other bytes with every unit on the device."""
        return sum(u.nbytes for u in self.units) + self.other_bytes

    @property
    def peak_flow(self) -> int:
        return device_peak(self.units, self.flowing, self.depth, self.other_bytes)

    def describe(self) -> str:
        n = sum(self.flowing)
        exposed = ("not predicted yet (after step 1, from the measured link and forward)" if self.exposed_s is None
                   else f"{self.exposed_s * 1e3:.2f} ms a step")
        free = "" if self.free_bytes is None else f" of {self.free_bytes / 1e6:.3f} MB free"
        if self.free_bytes is not None and self.margin_bytes:
            free += f" after a margin of {self.margin_bytes / 1e6:.3f} MB"
        return (f"flow choice {n} of {len(self.units)} units flow, prefetch depth {self.depth}; device peak "
                f"{self.peak_flow / 1e6:.3f} MB with flow, {self.peak_stationary / 1e6:.3f} MB stationary{free} "
                f"(activations {self.activation_bytes / 1e6:.3f} MB counted); exposed transfer {exposed}"
                + (f" ({self.reason})" if self.reason else ""))


def device_peak(units: Sequence[UnitCost], flowing: Sequence[bool], depth: int, other_bytes: int) -> int:
    """The stationary units' weights, the flowing window (FlowPlan.peak_bytes: a
    unit and the `depth` after it in forward order) and `other_bytes`."""
    kept = sum(u.nbytes for u, f in zip(units, flowing) if not f)
    window = FlowPlan(tuple(UnitSpec(u.name, (), u.nbytes) for u, f in zip(units, flowing) if f), (), depth)
    return kept + window.peak_bytes + other_bytes


def hiding_order(units: Sequence[UnitCost]) -> list[int]:
    """Unit indices, the unit whose fetch hides best first: the most forward compute per byte
    fetched (the link is one rate, so this is compute time per fetch time; an embedding, a gather
    with no multiply, hides worst). Among equal units (the decoder blocks) spread out: first, the
    middle and ends, halving the gaps (`spread_order`), so that the stationary ones between two
    flowing ones give the later fetch their compute too."""
    ratio = [round(u.compute / max(u.nbytes, 1), 9) for u in units]
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(ratio):
        groups.setdefault(r, []).append(i)
    order = []
    for r in sorted(groups, reverse=True):
        members = groups[r]
        order += [members[k] for k in spread_order(len(members))]
    return order


def spread_order(n: int) -> list[int]:
    """0..n-1, each prefix as evenly spread over the range as the prefixes before it allow:
    0, then n-1, then the middle, then the middles of the halves, ... (8: 0 7 3 1 5 2 4 6)."""
    if n <= 2:
        return list(range(n))
    order, seen = [0, n - 1], {0, n - 1}
    gaps = [(0, n - 1)]
    while len(order) < n:
        next_gaps = []
        for lo, hi in gaps:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            if mid not in seen:
                seen.add(mid)
                order.append(mid)
            next_gaps += [(lo, mid), (mid, hi)]
        if not next_gaps:
            break
        gaps = next_gaps
    return order + [i for i in range(n) if i not in seen]


def choose_flow(mode: str, units: Sequence[UnitCost], *, other_bytes: int, activation_bytes: int = 0,
                free_bytes: Optional[int], depth: int = 1, margin_bytes: int = 0) -> FlowChoice:
    """`mode` "flow": every unit flows. "auto": the fewest units flowing that fit `free_bytes` less
    `margin_bytes` (device_margin), taken in `hiding_order`; every unit when even that does not
    fit (the run may then run out of device memory: the message names the numbers).
    `other_bytes` includes `activation_bytes`."""
    if free_bytes is not None and mode == "auto":
        free_bytes = max(0, free_bytes - margin_bytes)
    else:
        margin_bytes = 0
    flowing = [mode == "flow"] * len(units)
    reason = "weights flow, every unit"
    if mode == "auto":
        reason = "weights auto"
        for i in hiding_order(units):
            if free_bytes is not None and device_peak(units, flowing, depth, other_bytes) <= free_bytes:
                break
            flowing[i] = True
        if free_bytes is not None and device_peak(units, flowing, depth, other_bytes) > free_bytes:
            reason += ", does not fit even with every unit flowing"
    return FlowChoice(tuple(units), tuple(flowing), depth, other_bytes, activation_bytes, free_bytes, None, reason,
                      margin_bytes)


def exposed_seconds(units: Sequence[UnitCost], flowing: Sequence[bool], depth: int, link_bytes_per_s: float,
                    seconds_per_compute: float, backward_factor: float = BACKWARD_FACTOR) -> float:
    """Predicted device seconds a step waits for fetches: forward in forward order, then backward
    in reverse (`backward_factor` x the forward compute), as engine/flow.py runs them. At the start
    of a flowing unit the flow stream is given its fetch (if not issued yet) and the next `depth`
    flowing units' fetches; one link, one fetch at a time; the unit starts when its fetch is done."""
    n = len(units)
    fetch = [u.nbytes / link_bytes_per_s for u in units]

    def one_pass(sequence: list[int], factor: float) -> float:
        flows = [i for i in sequence if flowing[i]]
        at = {i: k for k, i in enumerate(flows)}
        t = link = exposed = 0.0
        done: dict[int, float] = {}
        for i in sequence:
            if flowing[i]:
                for j in flows[at[i]:at[i] + depth + 1]:
                    if j not in done:
                        link = max(t, link) + fetch[j]
                        done[j] = link
                wait = max(0.0, done[i] - t)
                exposed, t = exposed + wait, t + wait
            t += units[i].compute * seconds_per_compute * factor
        return exposed

    return one_pass(list(range(n)), 1.0) + one_pass(list(range(n - 1, -1, -1)), backward_factor)


def choose_depth(choice: FlowChoice, link_bytes_per_s: float, seconds_per_compute: float,
                 headroom_bytes: Optional[int] = None, max_depth: int = MAX_DEPTH) -> FlowChoice:
    """The shallowest prefetch within DEPTH_TOLERANCE of the least exposed transfer time, among the
    depths whose extra window (over `choice.depth`'s) fits `headroom_bytes` (None: no limit).
    Deeper helps where a unit's fetch takes longer than the compute before its use and slower
    units come first (the head's backward, stationary units between flowing ones)."""
    base = choice.peak_flow
    times = {}
    for depth in range(1, max_depth + 1):
        extra = device_peak(choice.units, choice.flowing, depth, choice.other_bytes) - base
        if depth > 1 and headroom_bytes is not None and extra > headroom_bytes:
            break
        times[depth] = exposed_seconds(choice.units, choice.flowing, depth, link_bytes_per_s, seconds_per_compute)
    best = min(times.values())
    depth = min(d for d, s in times.items() if s <= best + DEPTH_TOLERANCE * max(best, 1e-12))
    return dataclasses.replace(choice, depth=depth, exposed_s=times[depth])


def unit_costs(model: torch.nn.Module, specs) -> list[UnitCost]:
    """`specs` (engine/flow.py UnitSpec) as UnitCosts, in forward order (the order the units'
    first modules are registered in: embedding, blocks, norm, head for transformers' models)."""
    roots = dict(find_units(model))
    position = {id(m): k for k, m in enumerate(model.modules())}
    costs = []
    for spec in specs:
        seen, compute = set(), 0
        for root in roots[spec.name]:
            for module in root.modules():
                if isinstance(module, torch.nn.Embedding):
                    continue
                for p in module.parameters(recurse=False):
                    if p.ndim >= 2 and id(p) not in seen:
                        seen.add(id(p))
                        compute += p.numel()
        first = min(position[id(m)] for m in roots[spec.name])
        costs.append((first, UnitCost(spec.name, spec.nbytes, compute)))
    return [cost for _, cost in sorted(costs, key=lambda c: c[0])]


def flow_plan_of(plan, choice: FlowChoice):
    """`plan` (every unit that may flow, FlowPlan) narrowed to the chosen units, in
    forward order, at the chosen depth; the others join its stationary list, with the reason."""
    spec_of = {u.name: u for u in plan.units}
    kept = tuple(f"{u.name} (weights auto: fits on the device)" for u, f in zip(choice.units, choice.flowing) if not f)
    return FlowPlan(tuple(spec_of[name] for name in choice.flowing_names), plan.stationary + kept, choice.depth)
