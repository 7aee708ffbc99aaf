"""``model``: upgrade the engine to different weights under the same served model name, cache kept.

The new release is a deterministic "v2" derived from SmolLM2 (seeded noise on every weight, see
``drills/stack/perturb_model.py``), built once per (seed, scale) into kvdrill's cache. With
``served_path: same`` the weights are swapped under the run's own model path (an in-place upgrade):
LMCache's keys name the model by that path, so v1's KV keeps being served to v2 (defect D12, incident
row 10). With ``served_path: new`` v2 is served from a new path, as when the revision is part of the
model name, and the keys change with it.

Once v2 serves, the scenario's oracle is asked again and its answers, tagged with the fault id
(``oracle_set``), are the reference for every request while the fault holds: salted, v2 itself with a
fresh cache_salt per prompt (proven cold like the first oracle wave), or the baseline engine, which is
then upgraded too. The proof is that v2 answers differently from v1 at all. Heal puts v1 back on every
engine it upgraded.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from drills.digest import sha256_file
from drills.pins import stack_python
from drills.stack.api import Capability
from drills.stack.sandbox import SERVED_MODEL, link_model, served_dir, swap_link
from injectors.base import HealReport, InjectionError, Injector, Proof

PERTURB = Path(__file__).resolve().parents[1] / "drills" / "stack" / "perturb_model.py"
UPGRADED = ("engine", "baseline")  # the baseline only where the stack runs one (oracle: baseline or both)


class ModelParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = Field(1, ge=0, description="seed of v2's weight noise")
    scale: float = Field(0.3, gt=0, le=1, description="noise per tensor, as a fraction of the tensor's std")
    served_path: Literal["same", "new"] = Field(
        "same", description="same: weights swapped under the same model path (in-place upgrade); new: v2 "
                            "served from a new path, as when the revision is in the model name")


def derived_weights_path(model_dir: Path, seed: int, scale: float) -> Path:
    """Where v2 of (seed, scale) lives: a pure function, so ``--dry-run`` shows it without building it."""
    return model_dir.with_name(f"{model_dir.name}-v2-s{seed}-x{scale:g}") / "model.safetensors"


def derived_weights(model_dir: Path, seed: int, scale: float) -> Path:
    """v2's safetensors file, built on first use next to the cached model (never inside a run)."""
    out = derived_weights_path(model_dir, seed, scale)
    out_dir = out.parent
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "model.safetensors.partial"
        proc = subprocess.run([str(stack_python()), str(PERTURB), str(model_dir / "model.safetensors"), str(tmp),
                               str(seed), str(scale)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise InjectionError(f"model: deriving v2 weights failed: {proc.stderr[-1500:]}")
        tmp.replace(out)
    return out


def undo(record: dict[str, Any]) -> HealReport:
    """Undo a weight swap from its ``fault.undo`` record, from any process: the served link points at the
    v1 weights again and the v2 served directory (symlinks only) is removed. Engines are not restarted
    here: ``kvdrill rollback`` stops the run's engines, and a next start reads v1. Idempotent."""
    report = HealReport()
    served, weights = Path(record["served_model_dir"]), Path(record["weights"])
    link = served / "model.safetensors"
    if link.is_symlink() and link.resolve() != weights.resolve():
        swap_link(link, weights)
        report.undone.append(f"{link} points at the v1 weights {weights} again")
    else:
        report.already_healed.append(f"{link} serves the v1 weights" if link.is_symlink() else f"{link} is gone")
    v2 = Path(f"{served}-v2")
    if v2.is_dir() and all(p.is_symlink() for p in v2.iterdir()):
        for p in v2.iterdir():
            p.unlink()
        v2.rmdir()
        report.undone.append(f"removed the v2 served directory {v2}")
    return report


class ModelUpgrade(Injector):
    name = "model"
    Params = ModelParams
    needs = (Capability.WEIGHT_SWAP,)

    def __init__(self, params: ModelParams, ctx) -> None:
        super().__init__(params, ctx)
        self.p: ModelParams = params
        self.v1: Path | None = None
        self.v2: Path | None = None
        self.injected_at: float | None = None
        self._healed = False

    @property
    def upgraded(self) -> list[str]:
        return [s for s in UPGRADED if s != "baseline" or self.ctx.stack.with_baseline]

    async def plan(self) -> list[dict[str, Any]]:
        stack = self.ctx.stack
        if self.ctx.oracle_wave is None:
            raise InjectionError("model: no oracle to ask for v2's answers")
        self.v1 = stack.model_dir / "model.safetensors"
        self.v2 = await asyncio.to_thread(derived_weights, stack.model_dir, self.p.seed, self.p.scale)
        return [{"services": self.upgraded, "served_model": SERVED_MODEL, "served_path": self.p.served_path,
                 "v1": {"path": str(self.v1), "sha256": sha256_file(self.v1)},
                 "v2": {"path": str(self.v2), "sha256": await asyncio.to_thread(sha256_file, self.v2),
                        "seed": self.p.seed, "scale": self.p.scale}}]

    def _serve(self, weights: Path) -> Path:
        stack = self.ctx.stack
        if self.p.served_path == "same":
            swap_link(stack.served_model_dir / "model.safetensors", weights)
            return stack.served_model_dir
        path = stack.served_model_dir if weights == self.v1 else served_dir(stack.run_dir, "-v2")
        link_model(stack.model_dir, path, weights=weights)
        stack.serve_model_from(path)
        return path

    async def _restart_upgraded(self) -> None:
        await asyncio.gather(*(self.ctx.stack.restart(name) for name in self.upgraded))

    async def inject(self) -> None:
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name,
                                undo={"weights": str(self.v1), "served_model_dir": str(self.ctx.stack.served_model_dir),
                                      "restart": self.upgraded})
        path = self._serve(self.v2)
        await self._restart_upgraded()
        self.injected_at = time.time()
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name,
                                model_path=str(path), weights=str(self.v2), oracle_set=self.ctx.fault_id,
                                service_down=False)

    async def verify(self) -> Proof:
        """v2's own no-cache answers become the oracle while the fault holds; v2 must differ from v1."""
        prompts = self.ctx.chaos_prompts or self.ctx.prompts
        v2 = await self.ctx.oracle_wave(prompts, oracle_set=self.ctx.fault_id)
        v1 = self.ctx.oracle_tokens or {}
        differ = [pid for pid, tokens in v2.items() if v1.get(pid) is not None and tokens != v1[pid]]
        return Proof(bool(differ), f"v2 (seed {self.p.seed}, scale {self.p.scale:g}) served as {SERVED_MODEL!r}: "
                                   f"its no-cache answer differs from v1's for {len(differ)}/{len(v2)} prompts",
                     [{"prompts_that_differ": differ, "oracle_set": self.ctx.fault_id}])

    async def heal(self) -> HealReport:
        report = HealReport()
        if self._healed or self.injected_at is None:
            report.already_healed.append("v1 weights")
            return report
        self._healed = True
        self._serve(self.v1)
        await self._restart_upgraded()
        report.undone.append(f"v1 weights served again from {self.ctx.stack.served_model_dir}; "
                             f"{' and '.join(self.upgraded)} restarted")
        return report
