"""The control plane: quorum rules, the coordinator service and its client, the wire protocol,
the state store (docs/architecture.md, "The step protocol")."""
