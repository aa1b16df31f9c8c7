"""gpuslo: GPU telemetry and SLO observability for Slurm and Kubernetes fleets."""

__version__ = "0.1.0"
