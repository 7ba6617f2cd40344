import grpc


class GatewayError(Exception):
    """An error the client sees as a gRPC status with a message that says what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
