"""The worker as a service: its gRPC server, registration, load reports, metrics and authentication."""
