"""The `diptych` command: runs each process of the platform on its own, or all of them with `up`."""
