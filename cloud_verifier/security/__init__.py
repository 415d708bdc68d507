"""Who may use the verifier and how much: API keys and tenants, TLS and the safe-bind rule, per-tenant limits."""
