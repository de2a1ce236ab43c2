"""Shared load state among gateway replicas through Redis (README.md). Imports nothing at package level:
`modeldock.config` mounts `sharing.config`, which must not load the rest."""
