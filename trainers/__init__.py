"""Lightning trainers that consume a policy's train topic and publish its policy versions."""
