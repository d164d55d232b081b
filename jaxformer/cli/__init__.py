"""The command line: ``jaxformer`` and its subcommands, one module per command,
one shared set of argument types and one error style. It imports the rest of the
package; nothing imports it.
"""
