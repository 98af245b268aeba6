"""graphfl.deploy"""
