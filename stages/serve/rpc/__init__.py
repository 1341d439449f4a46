"""The gRPC API (proto/llmopt/v1/generate.proto) beside the HTTP one, over the same engine and server state.

`start_grpc` is an app service (http/app.py's `Service`): `llmopt serve --grpc-port P` starts it on the
server's event loop with the `llmopt.v1.Generation` service, the standard grpc.health.v1 health service and
server reflection. Requests go through the HTTP side's own request models, admission, tenant quotas,
metrics (protocol="grpc") and `Generation`, so both APIs validate, limit and count alike (docs/grpc.md).
"""
from .server import start_grpc

__all__ = ["start_grpc"]
