"""Stats objects -> Prometheus series (metrics), and the thermal watch over sysfs (thermal)."""
