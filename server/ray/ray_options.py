"""RayOptions: ``serve --ray``'s replicas (how many, where, with what resources), frozen and
validated once; its fields declare their flags (loraplex.flag). Imports no ray: the parser
is built from it in every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...flag import flag

RAY = "Ray Serve scale-out (pip install loraplex[ray])"


@dataclass(frozen=True)
class RayOptions:
    """Either ``num_replicas`` or the autoscaling bounds ``min_replicas``/``max_replicas``;
    ``replica_gpus`` None means one GPU per replica on CUDA, none on CPU. After
    ``__post_init__`` exactly one form is set: ``num_replicas``, or both bounds."""

    address: str | None = flag(  # None: start a local cluster
        None, group=RAY, name="ray-address", metavar="ADDRESS",
        help="join this Ray cluster ('auto': the one `ray start` began here); default: start "
        "a local one")
    num_replicas: int | None = flag(None, group=RAY,
                                    help="fixed number of replicas (default 1)")
    min_replicas: int | None = flag(None, group=RAY, help="autoscaling: at least this many")
    max_replicas: int | None = flag(None, group=RAY, help="autoscaling: at most this many")
    replica_cpus: float = flag(1.0, group=RAY, help="CPUs per replica")
    replica_gpus: float | None = flag(None, group=RAY,
                                      help="GPUs per replica (default: 1 on CUDA, 0 on CPU)")
    num_cpus: int | None = None  # logical CPUs of a local cluster (default: the machine's)
    app_name: str = "loraplex"
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        autoscale = self.min_replicas is not None or self.max_replicas is not None
        if self.num_replicas is not None and autoscale:
            raise ValueError("give --num-replicas or --min-replicas/--max-replicas, not both")
        if autoscale:
            low = 1 if self.min_replicas is None else self.min_replicas
            high = self.max_replicas or max(low, 1)
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"--min-replicas {low} and --max-replicas {high} need "
                                 "0 <= min <= max and max >= 1")
            object.__setattr__(self, "min_replicas", low)  # the one form, completed
            object.__setattr__(self, "max_replicas", high)
        elif self.num_replicas is None:
            object.__setattr__(self, "num_replicas", 1)
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"--num-replicas {self.num_replicas} must be >= 1")
        if self.replica_cpus < 0 or (self.replica_gpus or 0) < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")

    @property
    def serving_replicas(self) -> int:
        """How many replicas must have joined before health says SERVING."""
        return self.num_replicas if self.num_replicas is not None else \
            max(self.min_replicas or 0, 1)

    def deployment_options(self, max_ongoing: int, target_ongoing: int, gpus: float
                           ) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": gpus},
            "max_ongoing_requests": max_ongoing,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": 30.0,
        }
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": target_ongoing}
        return opts
