"""Locate-then-edit editors (ROME, MEMIT, AlphaEdit) as unlearning methods: `facts` holds what they share,
`updates` their weight updates as pure functions, one module per method its parameters and entry point."""
