"""What server and client share on the wire: tensor codecs, TLS, gRPC options."""
