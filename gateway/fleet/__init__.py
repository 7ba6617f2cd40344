"""What the gateway knows of its workers: the registry, their live load reports and their token streams."""
