"""SGLang-specific knowledge: metric names, log formats, command-line flags.

Facts come from SGLang 0.5.23's source (and older formats where they changed); nothing outside this
package knows an SGLang name.
"""
