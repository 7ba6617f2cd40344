"""Capacity planning for disaggregated serving: a cost profile measured on real hardware, a discrete-event
simulation of a fleet under a workload, and the search for the cheapest fleet that meets an SLO."""
