"""RecGuide's offline fitting: shadow traces (`traces`, `shadow`), value model (`value_fit`), the price rho_C (`rho_search`) and the overlap planner (`overlap_fit`)."""
