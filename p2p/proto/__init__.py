"""Protobuf definitions of the peer-to-peer wire format."""
