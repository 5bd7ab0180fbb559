"""Drafting knobs: the dynamic window, survival stop, tree shape and confidence calibration, as one frozen record.

Self-contained so the plugin config (sgl_dspark.config) can build it; validated on construction, resolved against
the drafter's gamma once. Must not hold tensors or know about models.
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DraftKnobs:
    max_window: int | None = None  # most draft tokens on the main chain; None: gamma
    min_window: int = 1  # the main chain always drafts this many, whatever the survival
    survival_threshold: float = 0.0  # stop a branch once prod c (calibrated) falls below this; 0: never
    tree_width: int = 1  # 1: chain; else up to tree_width-1 extra children at low-confidence positions
    branch_threshold: float = 0.0  # branch where a node's calibrated confidence is below this
    max_nodes: int | None = None  # draft nodes per request, anchor excluded; None: max_window * tree_width
    confidence_temperatures: tuple[float, ...] = ()  # calibration temperature per draft position; missing: T = 1
    confidence_biases: tuple[float, ...] = ()  # calibration bias per draft position; missing: b = 0
    sampled_trees: bool = True  # sampled requests branch too, with i.i.d. siblings (else their blocks are chains)

    def __post_init__(self) -> None:
        if self.min_window < 0:
            raise ValueError(f"min_window must be >= 0, got {self.min_window}")
        if self.max_window is not None and self.max_window < max(self.min_window, 1):
            raise ValueError(f"max_window {self.max_window} must be >= max(min_window {self.min_window}, 1)")
        if not 0.0 <= self.survival_threshold <= 1.0 or not 0.0 <= self.branch_threshold <= 1.0:
            raise ValueError("survival_threshold and branch_threshold must be in [0, 1]")
        if self.tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {self.tree_width}")
        if any(t <= 0 for t in self.confidence_temperatures):
            raise ValueError("confidence_temperatures must be positive")

    def resolve(self, gamma: int) -> "DraftKnobs":
        """Fill the defaults that depend on the drafter's gamma; refuse windows it cannot draft."""
        window = gamma if self.max_window is None else self.max_window
        if window > gamma or self.min_window > gamma:
            raise ValueError(f"max_window {window} / min_window {self.min_window} exceed the drafter's gamma {gamma}")
        nodes = window * self.tree_width if self.max_nodes is None else self.max_nodes
        if nodes < window:
            raise ValueError(f"max_nodes {nodes} must be >= max_window {window}")
        return replace(self, max_window=window, max_nodes=nodes)

    def calibration(self, depth: int) -> tuple[float, float]:
        """(temperature, bias) of draft position `depth` (1-based; sgl_dspark.calibration.calibrated)."""
        temps, biases = self.confidence_temperatures, self.confidence_biases
        return (temps[depth - 1] if depth <= len(temps) else 1.0, biases[depth - 1] if depth <= len(biases) else 0.0)
