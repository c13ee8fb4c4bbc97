"""The real sidecar process under bad rings, full volumes, forged records, saturation and
hostile connections (``make test-reliability``)."""
