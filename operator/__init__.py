"""binbatch operator (kopf). Built in the operator issue; nothing here works yet."""
