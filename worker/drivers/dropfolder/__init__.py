"""The S3 drop folder (`visbatch watch`): `watcher` polls a prefix and makes one fleet job per
object, claimed once (`guard`: which prefixes it may watch; `keys`: where objects move)."""
