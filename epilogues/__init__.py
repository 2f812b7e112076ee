"""The library of ready epilogue programs (loaded by ``coda_cute.library``)."""
