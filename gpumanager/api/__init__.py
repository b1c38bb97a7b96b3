"""Generated protobuf and gRPC modules (from proto/ by scripts/gen_proto.py; never edited by hand)."""
