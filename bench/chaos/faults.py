"""The killer: every few seconds a random victim of the chosen kinds gets SIGKILL, and is started again
after a short random pause; one victim is down at a time, and the load goes on while it is."""

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

from bench.chaos.harness import ChaosPlatform
from bench.chaos.load import Load
from bench.progress import log

VICTIM_KINDS = ("prefill", "decode", "gateway", "control-plane", "jobs")


@dataclass(frozen=True)
class ChaosSettings:
    victims: tuple[str, ...]
    interval_s: tuple[float, float]  # between one victim's return and the next kill
    down_s: tuple[float, float]  # between a kill and the restart
    max_kills: int | None


@dataclass
class Kill:
    name: str
    kind: str
    killed_at_s: float
    back_at_s: float = 0.0


class Chaos:
    """Kills one process at a time and brings it back before choosing the next."""

    def __init__(self, platform: ChaosPlatform, settings: ChaosSettings, seed: int) -> None:
        self._platform = platform
        self._settings = settings
        self._rng = random.Random(seed)
        self.kills: list[Kill] = []
        self.exited_by_themselves: list[str] = []

    async def run(self, load: Load, duration_s: float, tail_s: float) -> None:
        """Kills until `duration_s` into the load; keeps the load running `tail_s` after each return."""
        until = load.started + duration_s
        while self._settings.max_kills is None or len(self.kills) < self._settings.max_kills:
            pause = self._rng.uniform(*self._settings.interval_s)
            if time.monotonic() + pause >= until:
                return
            await asyncio.sleep(pause)
            load.until = math.inf  # the load goes on while a victim is down, whatever the clock says
            try:
                self.exited_by_themselves += await asyncio.to_thread(self._platform.revive_exited)
                await self._kill_one(load.started)
            finally:
                load.until = max(until, time.monotonic() + tail_s)

    async def _kill_one(self, started: float) -> None:
        kind = self._rng.choice(self._settings.victims)
        name = self._rng.choice(self._platform.names(kind))
        down = self._rng.uniform(*self._settings.down_s)
        kill = Kill(name, kind, time.monotonic() - started)
        self.kills.append(kill)
        log(f"SIGKILL {name}; restarting it in {down:.1f} s")
        await asyncio.to_thread(self._platform.kill, name)
        await asyncio.sleep(down)
        await asyncio.to_thread(self._platform.restart, name)
        kill.back_at_s = time.monotonic() - started
        log(f"{name} serves again, {kill.back_at_s - kill.killed_at_s:.1f} s after its kill")

    def kills_by_kind(self) -> dict[str, int]:
        counts = Counter(k.kind for k in self.kills)
        return {kind: counts[kind] for kind in VICTIM_KINDS}
