"""The offline tools (`relax doctor | compare | inspect | bugreport`): they read what runs left
behind, never run in one, and nothing under relax/ but the CLI imports them (docs/architecture.md)."""
