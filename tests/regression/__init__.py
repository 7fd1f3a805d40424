"""Count regression gate: fixed request sets through the engine, exact counts against a baseline."""
