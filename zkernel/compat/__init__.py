"""Compatibility with other ZeRO implementations' inputs."""
