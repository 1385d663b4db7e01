"""pdserve's processes on a Ray cluster (`pdserve serve --backend ray`, `pdserve ray down|status`):
`plan` (pure: names, bundles, command lines, status rows), `actor` (one process under a Ray
actor), `backend` (placement, start order, teardown), `cli` (the flags). Ray is imported only
when a command runs: the package imports without it."""
