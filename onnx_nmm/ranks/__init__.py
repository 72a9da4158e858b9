"""Which rank or width each layer gets: the plan and its rules (rank_plan), the budget spent across layers
(rank_allocation), and the damage measured or predicted per choice (sensitivity)."""
