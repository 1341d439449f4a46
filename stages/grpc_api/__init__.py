"""The Python stubs of proto/llmopt/v1/generate.proto (`make proto` writes them; do not edit by hand).

`generate_pb2` holds the messages, `generate_pb2_grpc` the `Generation` service's client stub and servicer
base. Both the server (stages/serve/rpc) and the bench client (stages/bench) use them.
"""
SERVICE = "llmopt.v1.Generation"
