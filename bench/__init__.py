"""The serving benchmark: replays a synthetic workload against the platform (split and colocated) and
against plain `transformers` `generate`, and reports the figures side by side. `make bench` runs it."""
