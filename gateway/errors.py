import grpc


class GatewayError(Exception):
    """An error the client sees as a gRPC status with a message that says what to change.

    `retry_after_ms` is set when waiting that long makes the same request succeed (rate limits); the
    client gets it as trailing metadata `retry-after-ms` (gRPC) or a `Retry-After` header (HTTP).
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
