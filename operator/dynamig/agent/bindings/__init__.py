"""Binding conditions: how the agent answers each allocation of its devices, and what it keeps for
bookings."""
