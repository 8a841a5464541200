"""Boards reserved and described by EnOSlib (`backend: enoslib`), run by the ssh backend's
machinery: `backend`, `provider_section` (its section of the experiment, `provider:`),
`refusal` (the provider's rules), `providers` (EnOSlib's providers)."""
