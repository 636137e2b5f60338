"""Which parameters each module's forward must wait for, learned from the modules that ran.

A module whose forward pre-hook runs eagerly waits for its own parameters. Some parameters are
read by a forward that is not their module's own: `nn.MultiheadAttention` reads
`out_proj.weight` functionally (out_proj's forward never runs), a parent may call
`F.linear(x, self.embed.weight)`, and inside a `torch.compile`d region no hook runs at all (the
hooks return at once while dynamo traces them). Until the first step() the engine records the
modules whose forward pre-hook ran eagerly; then each parameter whose own modules never ran is
waited for by its nearest ancestor that did (MHA for its out_proj; for `torch.compile(model)`
the OptimizedModule wrapper, which runs eagerly). A parameter under no such module (a whole
model compiled in place with `model.compile()`, a parameter used outside any module) is an
orphan: its bucket is landed at the end of step(), before step() returns.

The map is computed once, module -> parameters, so a forward's wait costs what it did before.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Sequence

import torch


class ModuleReads:
    def __init__(self, params: Sequence[torch.Tensor]):
        self.owned = {id(p) for p in params}
        self._params = tuple(params)
        self.eager: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # added to by the forward hook
        self.of: Optional["weakref.WeakKeyDictionary[torch.nn.Module, tuple]"] = None  # None: not learned
        self.orphans: tuple = tuple(params)  # until learned: every bucket lands at the end of step()

    @property
    def learned(self) -> bool:
        return self.of is not None

    def own(self, module: torch.nn.Module) -> tuple:
        return tuple(p for p in module._parameters.values() if p is not None and id(p) in self.owned)

    def of_module(self, module: torch.nn.Module) -> Iterable[torch.Tensor]:
        """The parameters `module`'s forward waits for."""
        if self.of is not None:
            reads = self.of.get(module)
            if reads is not None:
                return reads
        return module._parameters.values()

    def learn(self) -> None:
        """From the modules whose forward ran eagerly so far (nothing if none did yet)."""
        eager = list(self.eager)
        if not eager:
            return
        parent: dict = {}
        stack, seen = list(eager), {id(m) for m in eager}
        while stack:
            module = stack.pop()
            for child in module.children():
                if id(child) not in seen:
                    seen.add(id(child))
                    parent[child] = module
                    stack.append(child)
        covered = {id(p) for m in eager for p in self.own(m)}
        assigned: dict = {m: list(self.own(m)) for m in eager}
        eager_set = set(eager)
        for module in list(parent):
            for p in self.own(module):
                if id(p) in covered:
                    continue
                ancestor = parent.get(module)
                while ancestor is not None and ancestor not in eager_set:
                    ancestor = parent.get(ancestor)
                if ancestor is not None:
                    assigned[ancestor].append(p)
                    covered.add(id(p))
        self.of = weakref.WeakKeyDictionary({m: tuple(ps) for m, ps in assigned.items()})
        self.orphans = tuple(p for p in self._params if id(p) not in covered)
