"""What a kernel costs on a NeuronCore, and the block sizes chosen by it: Trainium's numbers (hardware), the
formulas per instruction (instruction_costs), the modelled time of a traced kernel (cost_model), the block planner
(blocking) and the planner's plans run for comparison (plan_tracing)."""
