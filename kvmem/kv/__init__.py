"""Fact KV at rest: the blob format and the stores that hold blobs."""
