"""Adaptive speculation length: choose γ per verify step to maximise committed tokens per second.

Model (Leviathan et al. 2023, §3.4, extended with per-position acceptance and the network):
with α_i the probability that block position i is accepted given positions < i were, the expected tokens
committed by a block of γ draft tokens is

    E[tokens | γ] = 1 + Σ_{k=1..γ} Π_{i<k} α_i        (= (1 − α^(γ+1)) / (1 − α) for i.i.d. α)

and its expected wall time, measured on the edge, is

    T(γ) = γ · t_draft + t_verify(γ) + t_rtt,   t_verify(γ) = a + b · γ   (target forward, fitted online)

γ* = argmax_{1 ≤ γ ≤ γ_max} E[tokens | γ] / T(γ). All quantities are exponential moving averages of what
the client measures: per-position acceptance counts, draft ms per token, the verifier's forward ms per block
(Verdict.forward_ms), and the round trip minus the forward (network + queueing). Until enough steps are
seen, γ_max is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveGamma:
    """Online γ controller.

    Args:
        max_gamma: upper bound on γ (the client's num_speculative_tokens).
        ema: weight of a new observation in the moving averages (0 < ema <= 1).
        warmup_steps: steps at max_gamma before adapting.
    """

    max_gamma: int
    ema: float = 0.1
    warmup_steps: int = 3
    accept: list[float] = field(default_factory=list)  # α_i estimates, per position
    draft_ms_per_token: float = 0.0
    rtt_ms: float = 0.0  # round trip minus target forward (network + queueing), ms
    verify_base_ms: float = 0.0  # a: forward ms of a block at γ = 0
    verify_ms_per_token: float = 0.0  # b: extra forward ms per draft token
    steps: int = 0
    _fwd: dict = field(default_factory=dict)  # γ -> EMA of forward ms

    def __post_init__(self):
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        self.accept = [0.8] * self.max_gamma

    def _avg(self, old: float, new: float, first: bool) -> float:
        return new if first else (1 - self.ema) * old + self.ema * new

    def observe(self, gamma: int, num_accepted: int, draft_ms: float | None, round_trip_ms: float,
                forward_ms: float) -> None:
        """Record one verify step: block length γ, accepted count, edge draft time (None: drafted while hidden
        behind an earlier round trip, not a cost), round trip, target forward (ms)."""
        first = self.steps == 0
        self.steps += 1
        # per-position conditional acceptance: positions < num_accepted accepted, position num_accepted rejected
        for i in range(min(gamma, self.max_gamma)):
            if i < num_accepted:
                self.accept[i] = (1 - self.ema) * self.accept[i] + self.ema
            elif i == num_accepted:
                self.accept[i] = (1 - self.ema) * self.accept[i]
                break
        if gamma > 0 and draft_ms is not None:
            self.draft_ms_per_token = self._avg(self.draft_ms_per_token, draft_ms / gamma, first)
        self.rtt_ms = self._avg(self.rtt_ms, max(0.0, round_trip_ms - forward_ms), first)
        self._fwd[gamma] = self._avg(self._fwd.get(gamma, forward_ms), forward_ms, gamma not in self._fwd)
        if len(self._fwd) >= 2:  # least-squares line through the per-γ averages
            xs, ys = zip(*self._fwd.items())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
            self.verify_ms_per_token = max(0.0, b)
            self.verify_base_ms = max(0.0, my - self.verify_ms_per_token * mx)
        else:
            self.verify_base_ms = forward_ms

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens committed | γ] under the per-position acceptance estimates."""
        total, survive = 1.0, 1.0
        for i in range(gamma):
            survive *= self.accept[i]
            total += survive
        return total

    def expected_ms(self, gamma: int) -> float:
        return gamma * self.draft_ms_per_token + self.verify_base_ms + gamma * self.verify_ms_per_token + self.rtt_ms

    def next_gamma(self) -> int:
        """γ for the next block."""
        if self.steps < self.warmup_steps:
            return self.max_gamma
        best, best_rate = 1, -1.0
        for g in range(1, self.max_gamma + 1):
            rate = self.expected_tokens(g) / max(self.expected_ms(g), 1e-6)
            if rate > best_rate:
                best, best_rate = g, rate
        return best
