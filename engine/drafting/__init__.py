"""What s2moe drafts and when it stops: the drafters, the stopping rules and the copies of earlier text."""
