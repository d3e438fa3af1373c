"""Model output -> protocol-neutral events: reasoning split, tool-call parsers, forced-call grammars."""
