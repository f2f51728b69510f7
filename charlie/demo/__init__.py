"""`charlie demo`: a release engineer's task on a bundled sample repository."""
