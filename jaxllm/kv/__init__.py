"""KV memory: pools of fixed-size blocks per attention kind and the tables that name each
sequence's blocks (`paged`), the attention loop over them (`blockwise`), what each kind stores
(`options`) and how many blocks a pool gets (`plan`)."""
